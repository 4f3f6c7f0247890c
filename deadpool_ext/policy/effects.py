"""What a rule asks the coordinator to do: typed, frozen, and nothing else.

The coordinator carries each effect out (a change to its record, then what
goes out: a generation published, an agent told, an event said). A rule
returns a sequence of them; an empty one is "nothing to do".
"""

from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

from deadpool_ext.protocol import JobState


@dataclass(frozen=True)
class Note:
    """An event for the log; ``once``: said once per generation."""

    event: str
    fields: Mapping[str, object] = field(default_factory=dict)
    once: bool = False


@dataclass(frozen=True)
class Loss:
    """Slots that are gone. Their ranks are lost (a later trigger opens the
    generation for them); ``kill`` slots and ``kill_nodes`` nodes are
    SIGKILLed by their agents first (processes that live but cannot go on)."""

    slots: Tuple[str, ...]
    reason: str
    kill: Tuple[str, ...] = ()
    kill_nodes: Tuple[int, ...] = ()


@dataclass(frozen=True)
class Lost:
    """The slots of a loss count as gone (their spares with them)."""

    slots: Tuple[str, ...]


@dataclass(frozen=True)
class Opening:
    """The next generation, in which every member reports: after a failure
    (``lost`` ranks), a NaN or a corruption (every rank goes back), for a
    drain or a stop (DRAINING) or a grow (GROWING). ``notes`` announce it;
    ``assign`` names the spares that may start building now."""

    state: JobState
    cause: str  # failure, nan, sdc, drain, stop or grow
    notes: Tuple[Note, ...] = ()
    reasons: Tuple[str, ...] = ()  # why, for the decision
    lost: Tuple[int, ...] = ()
    leaving: Tuple[int, ...] = ()  # a drain's nodes
    assign: Mapping[int, str] = field(default_factory=dict)
    doomed: Optional[str] = None  # its decision stops the job, and why


@dataclass(frozen=True)
class Stop:
    """No decision can keep the job: it ends (an abort), and why."""

    reason: str


@dataclass(frozen=True)
class Advance:
    """Every member resumed or trained an iteration: the job moves on to
    ``state`` (``recovered``: a generation's recovery ended)."""

    state: JobState
    recovered: bool = False


@dataclass(frozen=True)
class Publish:
    """The generation again, naming the spares that may build now (of the
    ``ready`` spares)."""

    assign: Mapping[int, str]
    ready: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Rendezvous:
    """Every member arrived at the new groups' rendezvous: let them in."""


@dataclass(frozen=True)
class Admission:
    """A node's ``deadpool-launch --join``: accepted (its workers start as
    spares) or refused, and why."""

    node: int
    nonce: str
    refused: Optional[str] = None


@dataclass(frozen=True)
class QueueDrain:
    """Drain ``node`` at the next iteration boundary while training."""

    node: int
    reason: str
    by: str


@dataclass(frozen=True)
class StopAsked:
    """Stop the job at the next iteration boundary, saving its state."""

    reason: str
    by: str


@dataclass(frozen=True)
class SendOff:
    """A drained node leaves: its slots count as gone, its agent ends."""

    node: int
    reason: str


@dataclass(frozen=True)
class DropDrain:
    """A drain asked for that will not happen, and why."""

    node: int
    reason: str


@dataclass(frozen=True)
class Rollback:
    """Every rank goes back to redo ``iteration``, whose NaN ``rank`` found."""

    iteration: int
    rank: int


@dataclass(frozen=True)
class Redone:
    """Every rank finished a rolled-back iteration again without a NaN."""

    iteration: int
    rank: int


@dataclass(frozen=True)
class Caught:
    """A corruption caught: ``suspects`` at ``iteration``; ``forgive``: a
    swapped rank whose record starts afresh."""

    suspects: Tuple[int, ...]
    iteration: int
    forgive: Optional[int] = None


@dataclass(frozen=True)
class Judged:
    """The straggler watch's judgement: the stragglers now, and those whose
    drain was asked for."""

    stragglers: Mapping[int, object]
    drains_asked: Tuple[int, ...]


@dataclass(frozen=True)
class Wait:
    """No decision yet, and why; ``note``: the event that says so, once
    per generation (None: nothing worth saying, as while a successor settles)."""

    reason: str
    note: Optional[Note] = None


Effect = object  # any of the above
Effects = Tuple[Effect, ...]
NOTHING: Effects = ()


def note(event: str, once: bool = False, **fields) -> Note:
    return Note(event, dict(fields), once)


@dataclass(frozen=True)
class Majority:
    """Whether this coordinator hears a majority of the nodes alive at the
    last decision (``heard``); while it does not, it decides nothing."""

    heard: bool
    reason: str


@dataclass(frozen=True)
class Fence:
    """This coordinator's side of a partition leaves the job: the agents
    that still hear it kill their workers, and it ends deciding nothing."""

    reason: str


@dataclass(frozen=True)
class StandbyStore:
    """A node's launcher serves a store for a standby coordinator at ``address``."""

    node: int
    address: str


@dataclass(frozen=True)
class Appoint:
    """The coordinator's copy goes to ``node``'s store from now on: its
    launcher is the standby that takes over if this coordinator is lost
    (None: no node's; there is no standby)."""

    node: Optional[int]
