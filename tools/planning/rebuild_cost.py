"""What rebuilding a job's process groups costs after a failure, for a full
rebuild and a partial one: arithmetic on one rank's groups (role -> member
ranks, as ``python -m tools.layout_probe --groups`` reads them from
megatron-core) and on one group's costs as ``python -m tools.bench.recovery
--scale`` measures them (its groups' floor).

Full rebuild (what recovery does): every rank takes part in creating every
group of the world (torch's ``new_group`` is called by all ranks in the same
order, members or not), then connects to the peers of each group it holds.
Partial rebuild (``--deadpool-rebuild-groups changed``, docs/recovery.md):
a group whose members are all alive and unchanged is kept; a group with a
replaced, removed or added member is created again.

Costs are per rank, in seconds; a rebuild takes as long as its slowest rank.
"""

from dataclasses import dataclass
from typing import Dict, Iterable, List, Sequence, Set


@dataclass(frozen=True)
class GroupCosts:
    """A rank's cost of taking part in creating a group it is not in
    (``per_call``), and of a group it holds, per member of that group
    (``per_member``: its rendezvous reads every member's address, and gloo
    connects every pair)."""

    per_call: float
    per_member: float


def members(held: Dict[str, Sequence[int]]) -> int:
    return sum(len(ranks) for ranks in held.values())


def rebuilt_roles(held: Dict[str, Sequence[int]], changed: Iterable[int]) -> List[str]:
    """The held groups a partial rebuild creates again: those with a changed
    member (a replaced rank in a hot swap; in a resize every group whose
    membership differs)."""
    changed = set(changed)
    return [role for role, ranks in held.items() if changed.intersection(ranks)]


def full_rebuild_s(held: Dict[str, Sequence[int]], created: int, costs: GroupCosts) -> float:
    """Every rank calls for every group; it pays its own groups by size."""
    return (created - len(held)) * costs.per_call + members(held) * costs.per_member


def partial_rebuild_s(
    held: Dict[str, Sequence[int]], changed: Set[int], costs: GroupCosts
) -> float:
    """Only the groups with a changed member, by their members only."""
    again = {role: held[role] for role in rebuilt_roles(held, changed)}
    return members(again) * costs.per_member
