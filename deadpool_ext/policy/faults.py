"""A NaN's and a corruption's verdicts.

--deadpool-on-nan rollback: every rank goes back to the failed iteration's
start and redoes it; a NaN or Inf again where a rollback already went is no
transient fault, and the job stops. --deadpool-on-sdc: a corruption caught
is redone from memory the same way, its suspect swapped for a spare when it
is caught again within ``SDC_REPEAT_WINDOW`` iterations (or at once with
``swap``), or the job stops. Pure: the record keeps what was rolled back and
caught (the view's ``rolled_back``, ``redoing`` and ``caught``), a trigger
turns the verdicts into effects.
"""

from dataclasses import dataclass
from enum import Enum
from typing import List, Mapping, Optional, Tuple

from deadpool_ext.defaults import SDC_REPEAT_WINDOW
from deadpool_ext.protocol import NumericFault


class SdcAction(str, Enum):
    """What is done about one corruption."""

    ROLLBACK = "rollback"  # every rank redoes the iteration from memory
    SWAP = "swap"  # the suspect is replaced as a failing node
    STOP = "stop"


@dataclass(frozen=True)
class SdcVerdict:
    action: SdcAction
    rank: Optional[int]  # the suspect swapped (SWAP)
    why: str


def nan_again(fault: NumericFault, rolled_back) -> Optional[str]:
    """Why the job must stop instead of rolling back, or None: a NaN again
    where a rollback already went is no transient fault."""
    if fault.iteration not in rolled_back:
        return None
    return (
        f"rank {fault.rank} found a NaN or Inf again in iteration {fault.iteration} after "
        f"every rank went back to its start: not transient ({fault.error}); resume from "
        "the last --save checkpoint once its cause is fixed"
    )


def redone(redoing: Mapping[int, int], done: int) -> List[Tuple[int, int]]:
    """(iteration, rank) of each redo every rank has now finished: ``done``
    is the lowest iteration every rank finished."""
    return sorted((i, r) for i, r in redoing.items() if i <= done)


def corruption_verdict(
    fault: NumericFault,
    caught: Mapping[Tuple[int, ...], int],
    window: int = SDC_REPEAT_WINDOW,
) -> SdcVerdict:
    """Roll back, swap the suspect, or stop (``caught``: the last iteration
    each set of suspects was caught at, before this fault)."""
    suspects = tuple(sorted(fault.suspects))
    last = caught.get(suspects)
    again = last is not None and abs(fault.iteration - last) <= window
    where = (
        f"silent data corruption ({fault.check} check, iteration {fault.iteration}, "
        f"suspect rank(s) {', '.join(map(str, suspects)) or 'unknown'})"
    )
    if fault.on_sdc == "stop":
        return SdcVerdict(
            SdcAction.STOP,
            None,
            f"{where} (--deadpool-on-sdc stop): resume from the last --save "
            "checkpoint once the suspect node is checked",
        )
    single = suspects[0] if len(suspects) == 1 else None
    if single is not None and (again or fault.on_sdc == "swap"):
        why = f"caught again within {window} iterations" if again else "--deadpool-on-sdc swap"
        return SdcVerdict(
            SdcAction.SWAP, single, f"{where}: {why}; rank {single} is replaced as a failing node"
        )
    if again:
        return SdcVerdict(
            SdcAction.STOP,
            None,
            f"{where}, caught again within {window} iterations, and the "
            "check cannot tell which of the ranks holds the bad copy (two replicas): resume "
            "from the last --save checkpoint once their nodes are checked",
        )
    return SdcVerdict(
        SdcAction.ROLLBACK,
        None,
        f"{where}: every rank goes back to its newest snapshot from "
        f"before iteration {fault.iteration} and redoes it from memory",
    )
