"""Shrinking when spares run out, as pure rank arithmetic (after ReCoVer).

Every data-parallel replica that lost a rank leaves the job; the kept
replicas are renumbered, in order, into a world of TP x PP x DP' ranks, each
rank keeping its (tp, pp) position so its model shard stays valid. The
optimizer state of every old shard, the dropped ones included, must come
from a kept rank: the shard's owner (its own snapshot) or its buddy (the
copy it holds). The global batch does not change: its microbatches are
spread over the DP' replicas (``data.microbatches_per_iteration``).
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence, Set, Tuple

from deadpool_ext.buddies import rank_of
from deadpool_ext.control import parse_slot
from deadpool_ext.plan import Decision, Report, abort


@dataclass(frozen=True)
class Grid:
    """A job's TP x PP x DP layout and Megatron's rank order."""

    tp: int
    pp: int
    dp: int
    tp_pp_dp: bool = False

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return rank_of(tp, dp, pp, self.tp, self.dp, self.pp, self.tp_pp_dp)

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(tp, dp, pp) of a rank."""
        tp, rest = rank % self.tp, rank // self.tp
        if self.tp_pp_dp:
            return tp, rest // self.pp, rest % self.pp
        return tp, rest % self.dp, rest // self.dp

    def replica(self, rank: int) -> int:
        return self.coords(rank)[1]

    def with_dp(self, dp: int) -> "Grid":
        return Grid(self.tp, self.pp, dp, self.tp_pp_dp)


def renumber(grid: Grid, kept: Sequence[int]) -> Dict[int, int]:
    """Old rank -> new rank for the ranks of the kept replicas (in order)."""
    new_grid = grid.with_dp(len(kept))
    mapping = {}
    for new_dp, old_dp in enumerate(kept):
        for pp in range(grid.pp):
            for tp in range(grid.tp):
                mapping[grid.rank(tp, old_dp, pp)] = new_grid.rank(tp, new_dp, pp)
    return mapping


def shard_sources(grid: Grid, kept: Set[int], lost: Set[int], reports: Dict[int, Report],
                  buddy: Sequence[int]) -> Tuple[Dict[int, List], List[str]]:
    """For every old rank, who contributes its shard: itself from its own
    snapshot if it stays, else its buddy from the held copy if the buddy
    stays. Returns (sources, problems)."""
    sources: Dict[int, List] = {}
    problems: List[str] = []
    for rank in range(grid.world_size):
        report = reports.get(rank)
        if rank not in lost and grid.replica(rank) in kept and report and report.own:
            sources[rank] = [rank, "own"]
        elif buddy[rank] not in lost and grid.replica(buddy[rank]) in kept:
            sources[rank] = [buddy[rank], "held"]
        else:
            problems.append(f"rank {rank}'s optimizer shard has no copy on a kept replica "
                            f"(its buddy rank {buddy[rank]} is lost or leaves too)")
    return sources, problems


def common_iteration(sources: Dict[int, List], reports: Dict[int, Report]):
    """The newest iteration every contributor holds for its shard."""
    candidates = None
    for contributor, kind in sources.values():
        held = set(getattr(reports[contributor], kind))
        candidates = held if candidates is None else candidates & held
    return max(candidates) if candidates else None


def plan_shrink(gen: int, members: Dict[int, str], lost: Set[int], reports: Dict[int, Report],
                buddy: Sequence[int], grid: Grid) -> Decision:
    """Drop every replica that lost a rank; the rest go on as a smaller job.

    members: old rank -> slot; reports: from every live rank."""
    broken = {grid.replica(r) for r in lost}
    kept = [d for d in range(grid.dp) if d not in broken]
    if not kept:
        return abort(gen, f"no complete data-parallel replica is left: ranks "
                     f"{sorted(lost)} were lost from all {grid.dp} replicas", members)
    if buddy is None:
        return abort(gen, f"ranks {sorted(lost)} were lost and no copy of their optimizer "
                     "shards exists (the job runs without a mirror)", members)
    sources, problems = shard_sources(grid, set(kept), lost, reports, buddy)
    if problems:
        return abort(gen, "cannot shrink: " + "; ".join(problems), members)
    iteration = common_iteration(sources, reports)
    if iteration is None:
        return abort(gen, "cannot shrink: no iteration that every kept rank holds for every "
                     "shard", members)
    mapping = renumber(grid, kept)
    released = sorted(members[r] for r in members
                      if r not in lost and grid.replica(r) in broken)
    return Decision(gen=gen, action="shrink", rollback_to=iteration,
                    members={new: members[old] for old, new in mapping.items()},
                    renumber=mapping, sources=sources, released=released,
                    old_dp=grid.dp, new_dp=len(kept),
                    warnings=[f"shrinking from {grid.dp} to {len(kept)} data-parallel "
                              f"replicas: dropped replica(s) {sorted(broken)}"])


def world_of(decision: Decision) -> dict:
    """The world after a shrink: its size and each rank's node (named as the
    buddy placement names nodes)."""
    return {"size": decision.world_size,
            "nodes": [f"node{parse_slot(decision.members[r])[0]}"
                      for r in range(decision.world_size)]}
