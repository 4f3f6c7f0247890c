"""--deadpool-on-nan rollback's record: the iterations every rank went back
to redo after a NaN or Inf, and, until the redo is done, the rank that
found each. Pure: the coordinator says what the record tells it."""

from typing import Dict, List, Optional, Set, Tuple

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
