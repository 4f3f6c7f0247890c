"""Everything processes tell each other, typed in one place.

The messages on the control plane, the states they carry, the decisions,
the workers' environment and the exit codes (their defaults and tuning
constants are in ``defaults.py``).

Pure: no sockets and no torch. The wire (``wire.py``) signs and carries the
dict form of these messages; this module turns them into objects and back.
Enums derive from ``str`` (or ``int``), so their JSON form is the plain value.
"""

import os
from dataclasses import asdict, dataclass, field, fields
from enum import Enum, IntEnum
from typing import ClassVar, Dict, List, Mapping, Optional, Tuple

from deadpool_ext.defaults import (
    CONTROL_SILENCE_S,
    HEARTBEAT_TIMEOUT_S,
    METRICS_ADDR,
    ON_SDC,
    ON_SPARES_EXHAUSTED,
    ON_STRAGGLER,
    PROGRESS_TIMEOUT_S,
    RECOVERY_TIMEOUT_S,
    SPARE_WAIT_S,
    STRAGGLER_FACTOR,
    STRAGGLER_WINDOW,
)

# ----- names and places every process agrees on -----
COORDINATOR_RANK = -1  # the coordinator's "rank" in the event log
STANDBY_PORT_OFFSET = 1  # the standby's store listens on --master-port + 1
# Where ``deadpool-launch --standalone`` leaves the address and secret of its
# job for deadpool-ctl on the same host (a folder only its user can read).
RUN_DIR_ENV = "DEADPOOL_RUN_DIR"


class ExitCode(IntEnum):
    """Exit codes of deadpool-launch, its agents and its workers."""

    OK = 0
    FAILED = 1  # the job (or, for a worker, its coordinator) is lost
    USAGE = 2  # bad flags: nothing started (ConfigError.EXIT_CODE, argparse's own code)
    STOPPED_WITH_CHECKPOINT = 3  # launcher: spares ran out, the state is saved; resumable
    RELEASED = 4  # worker: a shrink dropped its replica; its slot turns spare
    ABORTED = 5  # worker: the coordinator's decision stops the job
    BUG = 6  # worker: a programming error (its traceback is in its
    # log): the coordinator stops the job
    LOCAL_FAILURE = 7  # worker: its own device or memory failed; replaced
    NUMERIC = 8  # worker: a NaN or Inf loss or gradient (--deadpool-on-nan stop): the job stops
    COORDINATOR_LOST = 9  # a node's launcher: the store and coordinator (node 0) went
    # away without stopping the job, and no standby took over; the job cannot go on
    # (examples/slurm/on_node.sh then ends the Slurm job, which would otherwise hold
    # its nodes)
    FENCED = 10  # a node's launcher (or a worker): its node was declared lost while it lived
    # (silent for the heartbeat timeout: cut off by the network, paused), or its
    # coordinator was cut off from the majority; it left once it knew, and the
    # job went on without it where the other side could. It may come back as a
    # spare with --join.


# ----- states -----
class JobState(str, Enum):
    """The coordinator's state of the current generation (published in ``gen``)."""

    STARTING = "starting"  # no iteration finished by every rank yet
    TRAINING = "training"
    RECOVERING = "recovering"  # a failure announced; the survivors report
    GROWING = "growing"  # spares fill a replica; every rank reports at its iteration's end
    REBUILDING = "rebuilding"  # a swap decided; the new generation builds and restores
    RESIZING = "resizing"  # a shrink, grow or checkpoint decided; carried out
    # Planned: named nodes leave, or the job stops (deadpool-ctl, Slurm's
    # DRAIN, a straggler); every rank reports at its iteration's end.
    DRAINING = "draining"
    STOPPING = "stopping"  # resumed after a checkpoint decision: saving, then done
    ABORTED = "aborted"


class WorkerState(str, Enum):
    """What a worker says it does, in every heartbeat."""

    STARTING = "starting"
    SPARE = "spare"
    TRAINING = "training"
    RECOVERING = "recovering"
    DONE = "done"


class Where(str, Enum):
    """Where a worker's main thread is, in every heartbeat: a rank that
    computes and never advances while a peer waits for it is hung."""

    COMPUTE = "compute"
    COMMUNICATION = "communication"  # in a collective, a send or a receive
    CHECKPOINT = "checkpoint"  # saving or loading


class Role(str, Enum):
    ACTIVE = "active"
    SPARE = "spare"


class Action(str, Enum):
    """What a decision does."""

    RECOVER = "recover"  # hot swap: spares take the lost ranks
    SHRINK = "shrink"  # drop the replicas that lost a rank
    GROW = "grow"  # spares make up new replicas
    CHECKPOINT = "checkpoint"  # gather every shard on the survivors, save, stop
    ABORT = "abort"

    @property
    def resizes(self) -> bool:
        return self in (Action.SHRINK, Action.GROW, Action.CHECKPOINT)


class Source(str, Enum):
    """Where a rank's optimizer shard is restored from."""

    OWN = "own"  # the rank's own snapshot
    HELD = "held"  # the copy its buddy holds


# ----- slots: a worker process's place -----
def slot_name(node: int, local: int) -> str:
    return f"{node}.{local}"


def parse_slot(slot: str) -> Tuple[int, int]:
    node, local = slot.split(".")
    return int(node), int(local)


# ----- where things live in the store -----
COORDINATOR_TOPIC = "coordinator"
CONTROL_TOPIC = "control"  # requests from deadpool-ctl and from agents
GEN_KEY = "gen"
# In the standby's store: the primary's state (written before anything the
# primary publishes, so the standby knows every decision a process can have
# seen) and its lease (renewed every heartbeat interval); agents that lost the
# primary say so on the standby topic.
STATE_KEY = "coordinator/state"
LEASE_KEY = "coordinator/lease"
# Put by the standby once the primary's state says the job ended: a process
# that loses the primary after that does not wait for a takeover.
ENDED_KEY = "coordinator/ended"
STANDBY_TOPIC = "standby"


def agent_topic(node: int) -> str:
    return f"agent/{node}"


def decision_key(gen: int) -> str:
    return f"decision/{gen}"


def join_key(gen: int) -> str:
    return f"join/{gen}"


def admission_key(nonce: str) -> str:
    return f"admit/{nonce}"


def control_reply_key(nonce: str) -> str:
    return f"control/reply/{nonce}"


def worker_heartbeat_key(slot: str) -> str:
    return f"hb/{slot}"


def node_heartbeat_key(node: int) -> str:
    return f"hb/node/{node}"


def stopping_key(node: int) -> str:
    """Put by a node's agent once it read its stop command, or once its
    workers all ended: the coordinator's store going away is then the job's
    end to it, not a loss, and the coordinator waits for it (up to a
    heartbeat timeout) before it closes that store."""
    return f"stopping/{node}"


# ----- messages to the coordinator -----
class Kind(str, Enum):
    NODE = "node"
    EXIT = "exit"
    PLAN = "plan"
    SPARE_READY = "spare_ready"
    REPORT = "report"
    JOINING = "joining"
    RESUMED = "resumed"
    DONE = "done"
    NUMERIC = "numeric"
    LOST_PRIMARY = "lost_primary"
    GPU_HEALTH = "gpu_health"
    CONTROL = "control"


class Message:
    """Base of the messages: ``body()`` is the wire form, ``parse`` the reverse."""

    KIND: ClassVar[Kind]

    def body(self) -> dict:
        return {"kind": self.KIND.value, **asdict(self)}


@dataclass
class NodeUp(Message):
    """An agent is starting its node's workers (``join``: a node added to a
    running job). Sent before they start: the coordinator reads its topic in
    order, so it knows a joining node before any of its spares says it is
    ready (a spare forked from a warm zygote is ready within milliseconds)."""

    KIND: ClassVar[Kind] = Kind.NODE
    node: int
    active: bool
    nproc: int
    join: bool = False
    nonce: Optional[str] = None
    # The launcher's --nnodes x --nproc-per-node, which every launcher must share.
    world_size: Optional[int] = None
    # host:port of the store its launcher serves for a standby coordinator
    # (with --standby-addr): where the coordinator may appoint one.
    standby_store: Optional[str] = None


@dataclass
class WorkerExited(Message):
    KIND: ClassVar[Kind] = Kind.EXIT
    slot: str
    code: int
    reason: Optional[str] = None  # why, as the worker wrote it (refused flags, its failure)


@dataclass
class Plan(Message):
    """Rank 0's layout, buddies and settings, once per world."""

    KIND: ClassVar[Kind] = Kind.PLAN
    gen: int
    buddy: Optional[List[int]]
    owner: Optional[List[int]]
    tp: int
    pp: int
    tp_pp_dp: bool
    distributed_timeout_minutes: Optional[float] = None
    train_iters: Optional[int] = None
    # Why this job cannot shrink (None: it can); spares exhausted then ends
    # it whatever --deadpool-on-spares-exhausted says.
    cannot_resize: Optional[str] = None
    # Replicas that leave together in a shrink (an MoE model's expert-
    # parallel groups span that many), and why the job cannot grow back.
    shrink_unit: int = 1
    cannot_grow: Optional[str] = None
    # The data-parallel sizes the job can run at (the interleaved schedule's
    # microbatch groups must fit each replica's share); None: any.
    data_parallel_sizes: Optional[List[int]] = None
    saves: bool = True  # --save given (deadpool-ctl stop says so when not)


@dataclass(frozen=True)
class CoordinatorSettings:
    """The --deadpool flags the coordinator acts on. The launcher reads them
    from the training script's flags (config.coordinator_settings) before
    any worker starts: the coordinator never runs on other values."""

    heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S
    recovery_timeout: float = RECOVERY_TIMEOUT_S
    progress_timeout: float = PROGRESS_TIMEOUT_S
    spare_wait: float = SPARE_WAIT_S
    on_spares_exhausted: str = ON_SPARES_EXHAUSTED
    events: Optional[str] = None  # --deadpool-events
    straggler_factor: float = STRAGGLER_FACTOR
    straggler_window: int = STRAGGLER_WINDOW
    on_straggler: str = ON_STRAGGLER
    metrics_port: Optional[int] = None  # --deadpool-metrics-port
    metrics_addr: str = METRICS_ADDR


@dataclass
class SpareReady(Message):
    KIND: ClassVar[Kind] = Kind.SPARE_READY
    slot: str


@dataclass
class Report(Message):
    """What a live rank can restore from, sent during a recovery."""

    KIND: ClassVar[Kind] = Kind.REPORT
    rank: int
    slot: str
    own: List[int]  # iterations of its own verified snapshots
    held: List[int]  # iterations of its owner's verified snapshots it holds
    gen: int = 0
    # --deadpool-rebuild-groups changed: each group without a lost member
    # whose connections this rank kept open, by group_key, with the number
    # of operations it issued on it (gloo's sequence number).
    groups: Dict[str, int] = field(default_factory=dict)


@dataclass
class Joining(Message):
    """A member arrived at the new generation's rendezvous."""

    KIND: ClassVar[Kind] = Kind.JOINING
    gen: int
    rank: int
    slot: str  # the sender: only the slot that holds the rank counts


@dataclass
class Resumed(Message):
    KIND: ClassVar[Kind] = Kind.RESUMED
    gen: int
    rank: int
    slot: str


@dataclass
class Done(Message):
    KIND: ClassVar[Kind] = Kind.DONE
    rank: int
    slot: str


@dataclass
class NumericFault(Message):
    """A rank's loss or gradients went NaN or Inf (--deadpool-on-nan
    rollback), or two copies that must agree differ (--deadpool-on-sdc):
    every rank goes back to the iteration's start and redoes it, unless the
    coordinator swaps a suspect or stops."""

    KIND: ClassVar[Kind] = Kind.NUMERIC
    gen: int
    rank: int
    slot: str
    iteration: int  # the one that failed, 1-based
    error: str  # megatron-core's validation message, or the check's
    check: str = "nan"  # or a corruption check: weight-hash, mirror-replay
    suspects: List[int] = field(default_factory=list)  # ranks that may hold the bad copy
    on_sdc: str = ON_SDC  # --deadpool-on-sdc


@dataclass
class LostPrimary(Message):
    """To the standby: this node's agent lost the primary coordinator (a
    vote for the takeover)."""

    KIND: ClassVar[Kind] = Kind.LOST_PRIMARY
    node: int


@dataclass
class GpuHealth(Message):
    """An agent's reading of its workers' GPUs (control/gpu_health.py's
    ``GpuReading`` as a dict, by slot): sent when a node starts and whenever
    a GPU's verdict changes."""

    KIND: ClassVar[Kind] = Kind.GPU_HEALTH
    node: int
    readings: Dict[str, dict]


class Request(str, Enum):
    """What an operator (deadpool-ctl) or an agent asks of a running job."""

    STATUS = "status"
    DRAIN = "drain"  # the node's ranks hand over to spares (or the job shrinks); it leaves
    STOP = "stop"  # save a checkpoint at the next iteration boundary and end the job


@dataclass
class ControlRequest(Message):
    """An operator's request (deadpool-ctl), or an agent's (its node was
    marked DRAIN by Slurm). The answer goes to ``control_reply_key(nonce)``."""

    KIND: ClassVar[Kind] = Kind.CONTROL
    request: str
    nonce: str
    node: Optional[int] = None  # DRAIN's node
    reason: str = ""
    by: str = "deadpool-ctl"


MESSAGES = {
    cls.KIND: cls
    for cls in (
        NodeUp,
        WorkerExited,
        Plan,
        SpareReady,
        Report,
        Joining,
        Resumed,
        Done,
        NumericFault,
        LostPrimary,
        GpuHealth,
        ControlRequest,
    )
}


class ProtocolError(ValueError):
    """A signed message of an unknown kind or shape (a version mismatch or a bug)."""


def parse_message(body: Mapping) -> Message:
    try:
        cls = MESSAGES[Kind(body.get("kind"))]
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in names})
    except (ValueError, TypeError) as error:
        raise ProtocolError(f"not a control message: {dict(body)!r} ({error})") from None


# ----- commands to an agent -----
class Command(str, Enum):
    KILL = "kill"  # SIGKILL one worker (``slot``)
    KILL_ALL = "kill_all"  # the node is lost: SIGKILL every worker
    STOP = "stop"  # the job ends: SIGTERM every worker
    LEAVE = "leave"  # the node was drained: restart no worker; end once none is left


# ----- the decision of a generation -----
@dataclass
class Decision:
    gen: int
    action: Action
    reason: str = ""
    rollback_to: Optional[int] = None  # the iteration everyone restarts (0-based start)
    members: Dict[int, str] = field(default_factory=dict)  # rank -> slot
    replaced: Dict[int, str] = field(default_factory=dict)  # rank -> spare slot taking it
    from_buddy: List[int] = field(default_factory=list)  # ranks restored from the buddy
    warnings: List[str] = field(default_factory=list)
    # A shrink or grow renumbers the members into another world; every old
    # shard comes from one contributor.
    renumber: Dict[int, int] = field(default_factory=dict)  # old rank -> new rank
    sources: Dict[int, List] = field(default_factory=dict)  # old rank -> [old rank, Source]
    released: List[str] = field(default_factory=list)  # live slots that leave
    old_dp: int = 0
    new_dp: int = 0
    kept: List[str] = field(default_factory=list)  # group_keys every member keeps
    # The GPUs of the spares it takes (slot -> their agent's last reading),
    # and the ready spares it left out because their GPU has a problem.
    gpus: Dict[str, str] = field(default_factory=dict)
    withheld: List[str] = field(default_factory=list)
    drained: List[int] = field(default_factory=list)  # nodes that leave (their slots: released)
    stop: bool = False  # the members save a checkpoint at rollback_to and the job ends

    def __post_init__(self):
        self.action = Action(self.action)

    @classmethod
    def abort(cls, gen: int, reason: str, members: Dict[int, str]) -> "Decision":
        """The decision that ends the job, and why."""
        return cls(gen=gen, action=Action.ABORT, reason=reason, members=dict(members))

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, slot: str) -> Optional[int]:
        return next((r for r, s in self.members.items() if s == slot), None)

    def has_place_for(self, slot: str) -> bool:
        """A member's, or a released one's (it leaves as told); a slot with
        neither was declared lost, and others hold its rank."""
        return self.rank_of(slot) is not None or slot in self.released

    def world(self) -> dict:
        """The world the decision makes: its size and each rank's node."""
        return {
            "size": self.world_size,
            "nodes": [f"node{parse_slot(self.members[r])[0]}" for r in range(self.world_size)],
        }

    def to_message(self) -> dict:
        body = asdict(self)
        body["action"] = self.action.value
        for name in ("members", "replaced", "renumber", "sources"):
            body[name] = {str(k): v for k, v in body[name].items()}
        return body

    @classmethod
    def from_message(cls, body: dict) -> "Decision":
        ints = {
            name: {int(k): v for k, v in body[name].items()}
            for name in ("members", "replaced", "renumber", "sources")
        }
        ints["renumber"] = {o: int(n) for o, n in ints["renumber"].items()}
        ints["sources"] = {o: list(src) for o, src in ints["sources"].items()}
        plain = {f.name: body[f.name] for f in fields(cls) if f.name not in ints}
        return cls(**plain, **ints)


# ----- the worker's environment, written by the agent, read by the worker -----
SECRET_ENV = "DEADPOOL_SECRET"
AGENT_ENV = "DEADPOOL_AGENT"  # the agent's settings (JSON), from the launcher
ERROR_FILE_ENV = "DEADPOOL_ERROR_FILE"  # why a worker stopped, for its agent
ERROR_TEXT_LIMIT = 4000  # characters of it the agent forwards


@dataclass(frozen=True)
class WorkerEnv:
    slot: str
    role: Role
    node: int
    store: str  # host:port of the coordinator's store
    ranks_per_node: int
    world_size: int
    rank: Optional[int]  # None for a spare: it learns its rank from a decision
    # Where the worker writes why it refused its flags (read by its agent,
    # as torchelastic's error file).
    error_file: Optional[str] = None
    # Its node's agent, and the process it dies with (parent-death signal):
    # the agent, or the zygote that forked it (control/zygote.py).
    agent_pid: Optional[int] = None
    parent_pid: Optional[int] = None
    # host:port of the standby coordinator's store when the worker started
    # (None: none yet; the generation names the current one), and how long
    # to wait for its takeover once the primary is gone (0: no standby).
    standby: Optional[str] = None
    takeover_wait_s: float = 0.0
    # When its control connections count as cut off (defaults.control_cut_off_s).
    cut_off_s: float = CONTROL_SILENCE_S

    def variables(self) -> Dict[str, str]:
        """What the agent adds to the worker's environment (torchrun's names too)."""
        env = {
            "DEADPOOL_SLOT": self.slot,
            "DEADPOOL_ROLE": self.role.value,
            "DEADPOOL_STORE": self.store,
            "DEADPOOL_NODE": str(self.node),
            "DEADPOOL_RANKS_PER_NODE": str(self.ranks_per_node),
            "LOCAL_RANK": str(parse_slot(self.slot)[1]),
            "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
            "WORLD_SIZE": str(self.world_size),
        }
        if self.rank is not None:
            env["RANK"] = str(self.rank)
        if self.error_file is not None:
            env[ERROR_FILE_ENV] = self.error_file
        if self.agent_pid is not None:
            env["DEADPOOL_AGENT_PID"] = str(self.agent_pid)
        if self.parent_pid is not None:
            env["DEADPOOL_PARENT_PID"] = str(self.parent_pid)
        if self.standby is not None:
            env["DEADPOOL_STANDBY"] = self.standby
        if self.takeover_wait_s:
            env["DEADPOOL_TAKEOVER_WAIT"] = str(self.takeover_wait_s)
        env["DEADPOOL_CUT_OFF"] = str(self.cut_off_s)
        return env

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> "WorkerEnv":
        rank = environ.get("RANK")
        return cls(
            slot=environ["DEADPOOL_SLOT"],
            role=Role(environ["DEADPOOL_ROLE"]),
            node=int(environ["DEADPOOL_NODE"]),
            store=environ["DEADPOOL_STORE"],
            ranks_per_node=int(environ["DEADPOOL_RANKS_PER_NODE"]),
            world_size=int(environ["WORLD_SIZE"]),
            rank=None if rank is None else int(rank),
            error_file=environ.get(ERROR_FILE_ENV),
            agent_pid=_pid(environ, "DEADPOOL_AGENT_PID"),
            parent_pid=_pid(environ, "DEADPOOL_PARENT_PID"),
            standby=environ.get("DEADPOOL_STANDBY"),
            takeover_wait_s=float(environ.get("DEADPOOL_TAKEOVER_WAIT", "0")),
            cut_off_s=float(environ.get("DEADPOOL_CUT_OFF", CONTROL_SILENCE_S)),
        )

    @property
    def store_address(self) -> Tuple[str, int]:
        return host_port(self.store)

    @property
    def standby_address(self) -> Optional[Tuple[str, int]]:
        return None if self.standby is None else host_port(self.standby)


def _pid(environ: Mapping[str, str], name: str) -> Optional[int]:
    return int(environ[name]) if name in environ else None


def host_port(address: str) -> Tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


# ----- process groups across generations -----
def group_key(ranks, occurrence: int) -> str:
    """A process group as every rank can name it: its members and how many
    groups of the same members were made before it in the generation (every
    rank makes every group, in the same order)."""
    return ",".join(map(str, ranks)) + f"#{occurrence}"


def group_members(key: str) -> List[int]:
    return [int(r) for r in key.split("#")[0].split(",")]
