"""The job as the coordinator knows it: its record, one generation's round, the rules' view.

``JobRecord`` is everything a takeover needs, replicated whole to the
standby; ``Round``, what one generation collects, by construction is not (a
takeover opens a new generation); ``view_of`` makes the frozen view the
rules judge.

The record's JSON is generated from its fields' types (pydantic's
``TypeAdapter`` over these dataclasses: a well-kept library that round-trips
sets, int-keyed maps, enums and nested dataclasses and checks every type on
the way back), so a field added to the record travels with it without a line
of serialisation; tests/unit_tests/control/test_record.py round-trips every
field.
"""

import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import pydantic

from deadpool_ext.control.membership import Membership
from deadpool_ext.policy.stragglers import node_times
from deadpool_ext.policy.states import AT_BOUNDARY, BUILDING, COLLECTING
from deadpool_ext.policy.view import (
    AgentEnded,
    JobView,
    Progress,
    Sighting,
    Straggler,
    as_tuple,
    plan_grid,
    limits_of,
)
from deadpool_ext.policy.effects import Caught, Lost, Opening, Redone, Rollback, StandbyStore
from deadpool_ext.protocol import (
    Action,
    CoordinatorSettings,
    Decision,
    JobState,
    Joining,
    Plan,
    Report,
    Resumed,
)


@dataclass
class RecoveryNote:
    """The last generation that resumed: what it was for and how long it took."""

    generation: int
    cause: str
    action: Optional[str]
    reason: str
    seconds: float
    rollback_to: Optional[int]
    stages: Dict[str, float]  # report, rebuild: seconds each


@dataclass
class JobRecord:
    """Everything a coordinator that takes over needs (not the timers, not
    a generation's reports: it opens a new one)."""

    settings: CoordinatorSettings
    membership: Membership
    gen: int = 0
    # Which coordinator decides: 0 the first, one more at each takeover. Every
    # event it says carries it, so that the log shows one writer per generation.
    term: int = 0
    state: JobState = JobState.STARTING
    lost: Set[int] = field(default_factory=set)  # ranks lost in this generation
    done: Set[int] = field(default_factory=set)  # ranks that finished
    plan: Optional[Plan] = None  # rank 0's layout and buddies, for this world
    train_iters: Optional[int] = None
    # The groups' own timeout (--distributed-timeout-minutes, from rank 0's
    # plan): what finally frees a rank stuck on gloo's queued send.
    group_timeout_s: Optional[float] = None
    doomed: Optional[str] = None  # why the next decision stops the job
    decision: Optional[Decision] = None  # the current generation's, as published
    stopping: Optional[Decision] = None  # a checkpoint or stop decided
    result: Optional[Decision] = None  # the abort that ended the job
    iterations: Dict[str, int] = field(default_factory=dict)  # slot -> last iteration beat
    # --deadpool-on-nan rollback: iterations redone after a NaN or Inf, and
    # until each redo is done, the rank that found it; --deadpool-on-sdc:
    # the last iteration each set of suspects was caught at.
    rolled_back: Set[int] = field(default_factory=set)
    redoing: Dict[int, int] = field(default_factory=dict)
    caught: List[Tuple[Tuple[int, ...], int]] = field(default_factory=list)
    # Operations: nodes asked to drain (node -> why), those a drain let go,
    # a stop asked for, and what each recovery was for.
    drains: Dict[int, str] = field(default_factory=dict)
    drained_nodes: Set[int] = field(default_factory=set)
    stop_request: Optional[str] = None
    recoveries: Dict[str, int] = field(default_factory=dict)  # by cause
    last_recovery: Optional[RecoveryNote] = None
    # With a standby coordinator: the node that coordinates, the stores the
    # nodes' launchers serve for a standby (node -> host:port, dropped once
    # one cannot be written), and the node whose store holds the copy now.
    coordinator_node: int = 0
    standby_stores: Dict[int, str] = field(default_factory=dict)
    standby_node: Optional[int] = None

    @classmethod
    def launched(cls, settings: CoordinatorSettings, nnodes: int, spare_nodes: int, nproc: int):
        return cls(settings, Membership.launched(nnodes, spare_nodes, nproc))

    @property
    def finished(self) -> bool:
        return self.result is not None or len(self.done) == self.membership.world_size

    def progress(self) -> Dict[int, int]:
        """rank -> the iteration its last heartbeat gave."""
        seen = self.iterations
        return {r: seen[slot] for r, slot in self.membership.members.items() if slot in seen}

    def take_plan(self, plan: Plan) -> None:
        """Rank 0's layout of this world; a spare that took rank 0 repeats
        it, and only the first counts."""
        if self.plan is not None:
            return
        self.plan, self.train_iters = plan, plan.train_iters
        if plan.distributed_timeout_minutes is not None:
            self.group_timeout_s = 60.0 * float(plan.distributed_timeout_minutes)

    def open(self, opening: Opening) -> None:
        """The next generation's numbers: its lost ranks, and why its
        decision stops the job. A stop decided and interrupted by a failure
        before every rank resumed is recovered from first; the stop (still
        asked for) comes after."""
        if self.stopping is not None and self.stopping.stop:
            self.stopping = None
        self.gen += 1
        self.lost |= set(opening.lost)
        self.doomed = opening.doomed or self.doomed

    def generation(self, assign: Dict[int, str]) -> dict:
        """The generation as processes read it (``gen``). ``boundary`` tells
        workers to stop at their next iteration boundary, not within an
        iteration (a grow, a drain, a stop)."""
        return dict(
            gen=self.gen,
            state=self.state,
            lost=sorted(self.lost),
            assign={str(r): s for r, s in assign.items()},
            world=self.membership.world,
            boundary=self.state in AT_BOUNDARY,
            # Where processes turn when they lose this coordinator (None: nowhere).
            standby=self.standby_stores.get(self.standby_node),
        )

    def adopt(self, decision: Decision, leaving: List[int]) -> Dict[int, Tuple[str, List[str]]]:
        """The decision's members form the generation (a resize's, another
        world: rank 0 of it sends its layout anew). The nodes a drain asked
        for are no longer asked for; those the decision drained leave (node
        -> why, its slots), before the nodes alive now become the quorum."""
        m = self.membership
        asked = {node: self.drains.pop(node, "") for node in leaving}
        if decision.action.resizes:
            m.world_size, m.world = decision.world_size, decision.world()
            self.plan = None
            self.iterations.clear()  # the old ranks' progress
        if decision.action == Action.CHECKPOINT or decision.stop:
            self.stopping = decision
        m.members = decision.members
        m.spares = [s for s in m.spares if s not in decision.replaced.values()]
        m.released |= set(decision.released)
        drained = {n: (why, self.send_off(n)) for n, why in asked.items() if n in decision.drained}
        m.quorum_nodes = m.alive_nodes()
        self.lost, self.decision = set(), decision
        return drained

    def send_off(self, node: int) -> List[str]:
        """A drained node: its slots count as gone (it may join again)."""
        self.drains.pop(node, None)
        slots = self.membership.slots_of(node)
        self.membership.lose(slots)
        self.drained_nodes.add(node)
        return slots

    def admit(self, node: int) -> List[str]:
        """A node that joins: its workers start as spares."""
        self.drained_nodes.discard(node)
        return self.membership.admit(node)

    @functools.singledispatchmethod
    def change(self, effect) -> None:
        """An effect that changes the record and nothing else."""
        raise AssertionError(f"coordinator bug: {effect!r} changes no record")

    def drop_store(self, node: int) -> int:
        """``node``'s store could not be written: not used again."""
        self.standby_stores.pop(node, None)
        if self.standby_node == node:
            self.standby_node = None
        return node

    @change.register
    def offer(self, o: StandbyStore) -> None:
        self.standby_stores[o.node] = o.address

    @change.register
    def lose_slots(self, lost: Lost) -> None:
        self.membership.lose(list(lost.slots))

    @change.register
    def roll_back(self, r: Rollback) -> None:
        self.rolled_back.add(r.iteration)
        self.redoing[r.iteration] = r.rank

    @change.register
    def redone(self, r: Redone) -> None:
        self.redoing.pop(r.iteration, None)

    @change.register
    def catch(self, c: Caught) -> None:
        """Suspects caught at an iteration; a forgiven rank's process is new
        (swapped): its record starts afresh."""
        caught = dict(self.caught)
        caught[c.suspects] = c.iteration
        if c.forgive is not None:
            caught = {s: i for s, i in caught.items() if c.forgive not in s}
        self.caught = list(caught.items())

    def note_recovered(self, round_: "Round", seconds: float) -> None:
        """What the generation that resumed was for, and how long it took."""
        cause = round_.cause or "failure"
        self.recoveries[cause] = self.recoveries.get(cause, 0) + 1
        decision = self.decision
        report_s = max(0.0, round_.decided_at - round_.opened_at)
        self.last_recovery = RecoveryNote(
            generation=self.gen,
            cause=cause,
            action=None if decision is None else decision.action.value,
            reason="" if decision is None else decision.reason,
            seconds=seconds,
            rollback_to=None if decision is None else decision.rollback_to,
            stages={"report": round(report_s, 3), "rebuild": round(seconds - report_s, 3)},
        )

    def to_json(self) -> str:
        return _codec().dump_json(self).decode()

    @classmethod
    def from_json(cls, text: str) -> "JobRecord":
        return _codec().validate_json(text)


@functools.lru_cache(maxsize=None)
def _codec() -> pydantic.TypeAdapter:
    return pydantic.TypeAdapter(JobRecord)


@dataclass
class Round:
    """What the current generation collects."""

    opened_at: float = 0.0
    cause: Optional[str] = None  # what opened it: failure, nan, sdc, drain, stop, grow
    reports: Dict[int, Report] = field(default_factory=dict)
    joining: Set[int] = field(default_factory=set)
    resumed: Set[int] = field(default_factory=set)
    leaving: List[int] = field(default_factory=list)  # a drain's nodes
    published_spares: Tuple[str, ...] = ()  # the ready spares when it was last published
    rendezvous: bool = False  # every member joined: the join key is out
    decided_at: float = 0.0
    # Why the generations since the last decision opened: the decision
    # says so (the dashboards' recovery line names the rank and the check).
    reasons: List[str] = field(default_factory=list)

    def collect(self, m, gen: int, state: JobState) -> None:
        """A rank's report, joining or resumption: taken if it is of this
        generation, in the phase that collects it."""
        if m.gen != gen:
            return
        if isinstance(m, Report) and state in COLLECTING:
            self.reports[m.rank] = m
        elif isinstance(m, Joining) and state in BUILDING:
            self.joining.add(m.rank)
        elif isinstance(m, Resumed) and state in BUILDING:
            self.resumed.add(m.rank)

    def next(self, now: float, opening: Opening, spares: List[str]) -> "Round":
        """The next generation's, carrying the reasons not yet decided on;
        ``spares``: the ready ones as it is published."""
        return Round(
            opened_at=now,
            cause=opening.cause,
            reasons=[*self.reasons, *opening.reasons],
            leaving=list(opening.leaving),
            published_spares=tuple(spares),
        )


@dataclass
class Watch:
    """What the coordinator keeps beside the record, not replicated: timers
    and the straggler watch's last judgement."""

    guards_quorum: bool = False  # a standby could take over: decide only with a majority
    cut_off_at: Optional[float] = None  # since it heard no majority
    fenced: Optional[str] = None  # why its side left the job
    took_over_at: Optional[float] = None  # until the first decision after a takeover
    drain_asked_at: Optional[float] = None  # the oldest drain pending
    stragglers: Dict[int, Straggler] = field(default_factory=dict)
    straggler_drains: Set[int] = field(default_factory=set)  # stragglers asked to drain
    said: Set[Tuple[str, int]] = field(default_factory=set)  # (event, generation) said once
    malformed_requests: int = 0  # signed requests of the wrong shape
    # Agents that ended, each with the inbox's claimed count then (``read_past``).
    agent_ends: List[Tuple[AgentEnded, int]] = field(default_factory=list)

    def read_past(self, cursor: int) -> List[AgentEnded]:
        """The agents' ends whose messages before them are read (the inbox's
        cursor past what was claimed when they ended): judged only then,
        since a slot written late holds back the ones after it."""
        due = [end for end, claimed in self.agent_ends if cursor >= claimed]
        self.agent_ends = self.agent_ends[len(due) :]  # the claimed counts only grow
        return due


def view_of(
    record: JobRecord,
    round_: Round,
    watch: Watch,
    look: Tuple[Optional[Sighting], Sighting, Dict[str, Progress], Dict[str, dict]],
    news: Tuple,
    now: float,
) -> JobView:
    """The frozen view the rules judge. ``look``: the heartbeats read this
    step (None: none), the latest look, each worker's progress and compute
    times (the detector's)."""
    sighting, last, main_threads, compute = look
    m, plan = record.membership, record.plan
    lost_slots = frozenset(m.lost_slots)
    members = [s for s in m.members.values() if s not in lost_slots]
    window = record.settings.straggler_window  # the straggler watch's times: after a look
    return JobView(
        gen=record.gen,
        members=dict(m.members),
        lost=frozenset(record.lost),
        reports=dict(round_.reports),
        spares=tuple(m.spares),
        buddy=None if plan is None else as_tuple(plan.buddy),
        owner=None if plan is None else as_tuple(plan.owner),
        grid=None if plan is None else plan_grid(plan, m.world_size),
        planned_dp=0 if plan is None else plan_grid(plan, m.planned_size).dp,
        limits=limits_of(plan, record.settings.on_spares_exhausted),
        state=record.state,
        doomed=record.doomed,
        warming=tuple(last.warming),
        since_opened_s=now - round_.opened_at,
        settings=record.settings,
        leaving=tuple(round_.leaving),
        stop_request=record.stop_request,
        plan=plan,
        group_timeout_s=record.group_timeout_s,
        train_iters=record.train_iters,
        planned_size=m.planned_size,
        nproc=m.nproc,
        nodes=tuple(m.nodes()),
        alive_nodes=frozenset(m.alive_nodes()),
        lost_slots=lost_slots,
        quorum_nodes=frozenset(m.quorum_nodes),
        guards_quorum=watch.guards_quorum,
        coordinator_node=record.coordinator_node,
        standby_node=record.standby_node,
        standby_stores=frozenset(record.standby_stores),
        cut_off_s=None if watch.cut_off_at is None else now - watch.cut_off_at,
        fenced=watch.fenced,
        done=frozenset(record.done),
        ended=record.result is not None,
        stopping=record.stopping,
        decision=record.decision,
        gpus={slot: m.gpus[slot].summary() for slot in m.spares if slot in m.gpus},
        withheld=tuple(sorted(m.withheld)),
        progress=record.progress(),
        joining=frozenset(round_.joining),
        rendezvous=round_.rendezvous,
        resumed=frozenset(round_.resumed),
        published_spares=round_.published_spares,
        since_decided_s=now - round_.decided_at,
        settling_s=None if watch.took_over_at is None else now - watch.took_over_at,
        reasons=tuple(round_.reasons),
        news=news,
        sighting=sighting,
        last_sighting=last,
        main_threads=main_threads,
        now=now,
        drains=dict(record.drains),
        since_drain_asked_s=0.0 if watch.drain_asked_at is None else now - watch.drain_asked_at,
        drained_nodes=frozenset(record.drained_nodes),
        node_times={} if sighting is None else node_times(compute, members, window),
        stragglers=dict(watch.stragglers),
        straggler_drains=frozenset(watch.straggler_drains),
        rolled_back=frozenset(record.rolled_back),
        redoing=dict(record.redoing),
        caught=dict(record.caught),
    )
