"""--deadpool-on-nan rollback's record: the iterations every rank went back
to redo after a NaN or Inf, and, until the redo is done, the rank that
found each; and --deadpool-on-sdc's, of the corruptions caught. Pure: the
coordinator says what the records tell it."""

from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

from deadpool_ext.defaults import SDC_REPEAT_WINDOW
from deadpool_ext.protocol import NumericFault


class Rollbacks:
    def __init__(self) -> None:
        self.rolled_back: Set[int] = set()
        self.redoing: Dict[int, int] = {}  # iteration -> the rank that found its NaN

    def roll_back(self, fault: NumericFault) -> Optional[str]:
        """Every rank redoes the fault's iteration. Why the job must stop
        instead, or None: a NaN again where a rollback already went is no
        transient fault."""
        again = fault.iteration in self.rolled_back
        self.rolled_back.add(fault.iteration)
        self.redoing[fault.iteration] = fault.rank
        if not again:
            return None
        return (
            f"rank {fault.rank} found a NaN or Inf again in iteration {fault.iteration} after "
            f"every rank went back to its start: not transient ({fault.error}); resume from "
            "the last --save checkpoint once its cause is fixed"
        )

    def redone(self, done: int) -> List[Tuple[int, int]]:
        """(iteration, rank) of each redo every rank has now finished, once:
        ``done`` is the lowest iteration every rank finished."""
        finished = sorted((i, r) for i, r in self.redoing.items() if i <= done)
        for iteration, _ in finished:
            del self.redoing[iteration]
        return finished

    def to_dict(self) -> dict:
        return {
            "rolled_back": sorted(self.rolled_back),
            "redoing": {str(i): r for i, r in self.redoing.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Rollbacks":
        record = cls()
        record.rolled_back = set(d["rolled_back"])
        record.redoing = {int(i): r for i, r in d["redoing"].items()}
        return record


@dataclass(frozen=True)
class SdcVerdict:
    """What the coordinator does about one corruption: roll every rank back,
    swap ``rank`` for a spare (or shrink), or stop, and why."""

    action: str  # rollback, swap or stop
    rank: Optional[int]
    why: str


class Corruptions:
    """--deadpool-on-sdc's record: the last iteration each set of suspects
    was caught at. Pure: the coordinator carries out the verdicts."""

    def __init__(self, window: int = SDC_REPEAT_WINDOW) -> None:
        self.window = window
        self.caught: Dict[Tuple[int, ...], int] = {}

    def decide(self, fault: NumericFault) -> SdcVerdict:
        suspects = tuple(sorted(fault.suspects))
        last = self.caught.get(suspects)
        self.caught[suspects] = fault.iteration
        again = last is not None and abs(fault.iteration - last) <= self.window
        where = (
            f"silent data corruption ({fault.check} check, iteration {fault.iteration}, "
            f"suspect rank(s) {', '.join(map(str, suspects)) or 'unknown'})"
        )
        if fault.on_sdc == "stop":
            return SdcVerdict(
                "stop",
                None,
                f"{where} (--deadpool-on-sdc stop): resume from the last --save "
                "checkpoint once the suspect node is checked",
            )
        single = suspects[0] if len(suspects) == 1 else None
        if single is not None and (again or fault.on_sdc == "swap"):
            why = (
                f"caught again within {self.window} iterations"
                if again
                else "--deadpool-on-sdc swap"
            )
            return SdcVerdict(
                "swap", single, f"{where}: {why}; rank {single} is replaced as a failing node"
            )
        if again:
            return SdcVerdict(
                "stop",
                None,
                f"{where}, caught again within {self.window} iterations, and the "
                "check cannot tell which of the ranks holds the bad copy (two replicas): resume "
                "from the last --save checkpoint once their nodes are checked",
            )
        return SdcVerdict(
            "rollback",
            None,
            f"{where}: every rank goes back to its newest snapshot from "
            f"before iteration {fault.iteration} and redoes it from memory",
        )

    def forget(self, rank: int) -> None:
        """A swapped rank's process is new: its record starts afresh."""
        self.caught = {s: i for s, i in self.caught.items() if rank not in s}

    def to_dict(self) -> dict:
        return {"caught": [[list(s), i] for s, i in self.caught.items()]}

    @classmethod
    def from_dict(cls, d: dict) -> "Corruptions":
        record = cls()
        record.caught = {tuple(s): i for s, i in d["caught"]}
        return record
