"""What the rules see: a frozen ``JobView`` of the job at one step, and
what it is made of.

The coordinator builds it from its record (control/record.py), the
generation's round, the detector's last look and the news of the step, and
hands it to every trigger and to ``Policy.decide``. Nothing in a view
changes while a rule reads it; a rule returns effects (effects.py) and
never writes.
"""

from dataclasses import dataclass, field
from typing import FrozenSet, Mapping, Optional, Sequence, Tuple

from deadpool_ext.defaults import ON_SPARES_EXHAUSTED
from deadpool_ext.protocol import (
    CoordinatorSettings,
    Decision,
    JobState,
    Plan,
    Report,
    Where,
    parse_slot,
)
from deadpool_ext.topology import Grid

S = JobState


# ----- what the detector saw -----
@dataclass
class Progress:
    """What a worker's beats said of its main thread, and since when."""

    iteration: Optional[int] = None
    advanced_at: float = 0.0  # when its iteration last changed
    where: Optional[str] = None
    where_since: float = 0.0  # since when every beat said ``where``
    host: Optional[str] = None  # its address on its groups' connections
    # Peer host -> seconds its connections to it had waited for an
    # acknowledgement, as its last beat said (rank/client.py).
    silent: Mapping[str, float] = field(default_factory=dict)

    def observe(self, body: dict, now: float) -> None:
        if body.get("iteration") != self.iteration:
            self.iteration, self.advanced_at = body.get("iteration"), now
        if body.get("where") != self.where:
            self.where, self.where_since = body.get("where"), now
        self.host = body.get("host", self.host)
        self.silent = body.get("silent") or {}

    def computing_without_progress(self, now: float) -> float:
        """Seconds its main thread has computed without finishing an iteration."""
        if self.where != Where.COMPUTE:
            return 0.0
        return now - max(self.advanced_at, self.where_since)

    def waiting(self, now: float) -> float:
        """Seconds it has been waiting on peers (communication) without progress."""
        if self.where != Where.COMMUNICATION:
            return 0.0
        return now - max(self.advanced_at, self.where_since)


@dataclass(frozen=True)
class Sighting:
    """One look at every heartbeat."""

    silent_nodes: Tuple[int, ...] = ()  # stopped for the timeout
    hung_slots: Tuple[str, ...] = ()  # silent workers on beating nodes
    states: Mapping[str, Optional[str]] = field(default_factory=dict)  # slot -> its last state
    warming: Tuple[str, ...] = ()  # processes still starting
    beating: FrozenSet[int] = frozenset()  # nodes whose agent beats
    # Nodes whose agent beat within half the timeout: the majority rule's
    # (admission.py), so that one node's silence is judged only while most
    # of the others are heard from, not while they too fall silent.
    heard: FrozenSet[int] = frozenset()


@dataclass(frozen=True)
class Straggler:
    node: int
    compute_s: float  # its ranks' median compute time per iteration
    others_s: float  # the other nodes' median of the same
    ratio: float
    iteration: int  # the last iteration its figures include


# ----- the news of one step: what happened that a rule must judge -----
@dataclass(frozen=True)
class Exited:
    """An agent saw a worker's process end."""

    slot: str
    code: int
    reason: Optional[str]
    rank: Optional[int]  # the rank its slot held
    released: bool  # it left on a shrink (its agent starts a spare there)


@dataclass(frozen=True)
class AgentEnded:
    """A node's agent process ended (seen by the launcher that started it)."""

    node: int
    code: int


@dataclass(frozen=True)
class TookOver:
    """This coordinator took over from the primary on node ``node``."""

    node: int
    reason: str
    node_alive: bool  # its agent came over: only its launcher died


@dataclass(frozen=True)
class Superseded:
    """The standby's store shows that it took over while this coordinator
    was cut off from the majority."""


# ----- the layout's limits, from rank 0's plan -----
@dataclass(frozen=True)
class Limits:
    """What the job's layout allows (rank 0's plan of each world)."""

    on_spares_exhausted: str = ON_SPARES_EXHAUSTED
    shrink_unit: int = 1  # replicas that leave together (an MoE model's EP groups span them)
    data_parallel_sizes: Optional[Tuple[int, ...]] = None  # None: any size runs
    cannot_resize: Optional[str] = None  # why the job cannot shrink (None: it can)
    cannot_grow: Optional[str] = None


def as_tuple(items: Optional[Sequence]) -> Optional[tuple]:
    """A plan's list, frozen for a view (None stays None)."""
    return None if items is None else tuple(items)


def limits_of(plan: Optional[Plan], on_spares_exhausted: str) -> Limits:
    """What rank 0's plan says the layout allows (before it came: no more
    than the setting)."""
    if plan is None:
        return Limits(on_spares_exhausted)
    return Limits(
        on_spares_exhausted,
        plan.shrink_unit,
        as_tuple(plan.data_parallel_sizes),
        plan.cannot_resize,
        plan.cannot_grow,
    )


def plan_grid(plan: Plan, world_size: int) -> Grid:
    """The plan's layout over ``world_size`` ranks."""
    return Grid(plan.tp, plan.pp, world_size // (plan.tp * plan.pp), plan.tp_pp_dp)


@dataclass(frozen=True)
class JobView:
    """The job as the rules see it at one step. The first fields are what
    a generation's decision needs; the rest what the triggers judge."""

    gen: int
    members: Mapping[int, str] = field(default_factory=dict)  # rank -> slot
    lost: FrozenSet[int] = frozenset()  # ranks lost in this generation
    reports: Mapping[int, Report] = field(default_factory=dict)  # from the live members
    spares: Tuple[str, ...] = ()  # ready spare slots
    buddy: Optional[Tuple[int, ...]] = None  # None: the job runs without a mirror
    owner: Optional[Tuple[int, ...]] = None
    grid: Optional[Grid] = None
    planned_dp: int = 0  # the data-parallel size the job was launched with
    limits: Limits = Limits()
    state: JobState = S.RECOVERING
    doomed: Optional[str] = None  # why this generation's decision stops the job
    warming: Tuple[str, ...] = ()  # spare processes still starting
    since_opened_s: float = 0.0  # since this generation opened
    settings: CoordinatorSettings = CoordinatorSettings()
    leaving: Tuple[int, ...] = ()  # the nodes a DRAINING generation drains
    stop_request: Optional[str] = None  # why a stop was asked for (None: none)
    # ----- the job -----
    plan: Optional[Plan] = None  # rank 0's, for this world
    group_timeout_s: Optional[float] = None  # --distributed-timeout-minutes, from a plan
    train_iters: Optional[int] = None
    planned_size: int = 0  # the launched world, which a shrunk job grows back to
    nproc: int = 1  # ranks per node
    nodes: Tuple[int, ...] = ()  # every node of the job
    alive_nodes: FrozenSet[int] = frozenset()
    lost_slots: FrozenSet[str] = frozenset()
    quorum_nodes: FrozenSet[int] = frozenset()  # alive at the last decision
    guards_quorum: bool = False  # a standby could take over: decide only with a majority
    coordinator_node: int = 0  # whose launcher coordinates
    standby_node: Optional[int] = None  # whose store holds the coordinator's copy
    standby_stores: FrozenSet[int] = frozenset()  # nodes whose launcher serves one
    cut_off_s: Optional[float] = None  # since it heard no majority (None: it hears one)
    fenced: Optional[str] = None  # why this coordinator's side left the job
    done: FrozenSet[int] = frozenset()  # ranks that finished
    ended: bool = False  # an abort was decided
    stopping: Optional[Decision] = None  # a checkpoint or stop decided and carried out
    decision: Optional[Decision] = None  # this generation's, once decided
    gpus: Mapping[str, str] = field(default_factory=dict)  # spare slot -> its GPU's summary
    withheld: Tuple[str, ...] = ()  # ready spares kept out for their GPU's problems
    progress: Mapping[int, int] = field(default_factory=dict)  # rank -> last iteration beat
    # ----- this generation -----
    joining: FrozenSet[int] = frozenset()
    rendezvous: bool = False  # every member joined: the join key is out
    resumed: FrozenSet[int] = frozenset()
    published_spares: Tuple[str, ...] = ()  # the ready spares when it was last published
    since_decided_s: float = 0.0
    settling_s: Optional[float] = None  # since a takeover, until every agent beat here
    reasons: Tuple[str, ...] = ()  # why the generations since the last decision opened
    # ----- what this step brought -----
    news: Tuple[object, ...] = ()  # Exited, AgentEnded, TookOver and protocol messages
    sighting: Optional[Sighting] = None  # a look at the heartbeats this step (None: none)
    last_sighting: Sighting = Sighting()  # the latest look
    main_threads: Mapping[str, Progress] = field(default_factory=dict)  # slot -> its progress
    now: float = 0.0
    # ----- operations -----
    drains: Mapping[int, str] = field(default_factory=dict)  # node -> why, asked for
    since_drain_asked_s: float = 0.0  # since the oldest drain pending was asked for
    drained_nodes: FrozenSet[int] = frozenset()  # left by a drain
    node_times: Mapping[int, Tuple[float, int]] = field(default_factory=dict)  # straggler watch
    stragglers: Mapping[int, Straggler] = field(default_factory=dict)  # the last judgement's
    straggler_drains: FrozenSet[int] = frozenset()  # stragglers whose drain was asked for
    # ----- faults -----
    rolled_back: FrozenSet[int] = frozenset()  # iterations redone after a NaN or Inf
    redoing: Mapping[int, int] = field(default_factory=dict)  # iteration -> rank that found it
    caught: Mapping[Tuple[int, ...], int] = field(default_factory=dict)  # suspects -> iteration

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def growing(self) -> bool:
        return self.state == S.GROWING

    @property
    def finished(self) -> bool:
        return self.ended or (bool(self.members) and len(self.done) == self.world_size)

    @property
    def draining(self) -> FrozenSet[int]:
        """The ranks of the nodes a DRAINING generation drains."""
        nodes = set(self.leaving)
        return frozenset(r for r, slot in self.members.items() if parse_slot(slot)[0] in nodes)

    @property
    def waiting(self) -> Tuple[int, ...]:
        """Live members that have not reported in this generation."""
        return tuple(r for r in self.members if r not in self.lost and r not in self.reports)

    @property
    def iteration(self) -> int:
        """The newest iteration a member's heartbeat gave."""
        return max(self.progress.values(), default=0)

    def ranks_on(self, node: int) -> Tuple[int, ...]:
        return tuple(sorted(r for r, s in self.members.items() if parse_slot(s)[0] == node))

    def slots_of(self, node: int) -> Tuple[str, ...]:
        return tuple(f"{node}.{i}" for i in range(self.nproc))

    def rank_of(self, slot: str) -> Optional[int]:
        return next((r for r, s in self.members.items() if s == slot), None)

    def news_of(self, kind: type) -> Tuple:
        return tuple(item for item in self.news if isinstance(item, kind))
