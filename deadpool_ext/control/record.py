"""The job as the coordinator knows it: ``JobRecord``, everything a
takeover needs, replicated whole to the standby; ``Round``, what one
generation collects, which by construction is not (a takeover opens a new
generation); and ``view_of``, the frozen view the rules judge.

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
from deadpool_ext.policy.view import (
    JobView,
    Progress,
    Sighting,
    Straggler,
    as_tuple,
    grid_of,
    limits_of,
)
from deadpool_ext.protocol import CoordinatorSettings, Decision, JobState, Plan, Report


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

    def catch(self, suspects: Tuple[int, ...], iteration: int, forgive: Optional[int]) -> None:
        """Suspects caught at ``iteration``; a ``forgive``n rank's process
        is new (swapped): its record starts afresh."""
        caught = dict(self.caught)
        caught[suspects] = iteration
        if forgive is not None:
            caught = {s: i for s, i in caught.items() if forgive not in s}
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
    assign: Dict[int, str] = field(default_factory=dict)  # the spares last published for it
    rendezvous: bool = False  # every member joined: the join key is out
    decided_at: float = 0.0
    # Why the generations since the last decision opened: the decision
    # says so (the dashboards' recovery line names the rank and the check).
    reasons: List[str] = field(default_factory=list)

    def next(self, now: float, cause: str) -> "Round":
        """The next generation's, carrying the reasons not yet decided on."""
        return Round(opened_at=now, cause=cause, reasons=list(self.reasons))


@dataclass
class Watch:
    """What the coordinator keeps beside the record, not replicated: timers
    and the straggler watch's last judgement."""

    guards_quorum: bool = False  # a standby could take over: decide only with a majority
    took_over_at: Optional[float] = None  # until the first decision after a takeover
    drain_asked_at: Optional[float] = None  # the oldest drain pending
    stragglers: Dict[int, Straggler] = field(default_factory=dict)
    straggler_drains: Set[int] = field(default_factory=set)  # stragglers asked to drain
    said: Set[Tuple[str, int]] = field(default_factory=set)  # (event, generation) said once
    malformed_requests: int = 0  # signed requests of the wrong shape
    status_sent_at: float = float("-inf")  # when the status listeners last heard


def view_of(
    record: JobRecord,
    round_: Round,
    watch: Watch,
    look: Tuple[Optional[Sighting], Sighting, Dict[str, Progress], Dict[str, dict]],
    news: Tuple,
    now: float,
    guards_quorum: bool,
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
        grid=None if plan is None else grid_of(plan, m.world_size),
        planned_dp=0 if plan is None else grid_of(plan, m.planned_size).dp,
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
        guards_quorum=guards_quorum,
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
        assign=dict(round_.assign),
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
