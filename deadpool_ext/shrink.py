"""Shrinking when spares run out, as pure rank arithmetic (after ReCoVer).

Every data-parallel replica that lost a rank leaves the job; the kept
replicas are renumbered, in order, into a world of TP x PP x DP' ranks, each
rank keeping its (tp, pp) position so its model shard stays valid. When
ranks were lost from every replica, the survivors of the broken replicas
still make up whole replicas if every position kept a rank: DP replicas hold
the same weights, so a replica assembled from ranks of several is as good. The
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


Position = Tuple[int, int]  # (tp, pp)


def positions(grid: Grid) -> List[Position]:
    return [(tp, pp) for pp in range(grid.pp) for tp in range(grid.tp)]


def whole_replica(grid: Grid, dp: int) -> Dict[Position, int]:
    return {(tp, pp): grid.rank(tp, dp, pp) for tp, pp in positions(grid)}


def kept_replicas(grid: Grid, lost: Set[int]) -> List[Dict[Position, int]]:
    """The replicas of the smaller job, each a rank per position: the intact
    old replicas in order, then as many as the broken replicas' survivors
    make up, taking at each position its survivors in replica order."""
    broken = sorted({grid.replica(r) for r in lost})
    kept = [whole_replica(grid, d) for d in range(grid.dp) if d not in broken]
    left = {pos: [r for r in (grid.rank(pos[0], d, pos[1]) for d in broken) if r not in lost]
            for pos in positions(grid)}
    assembled = min(len(ranks) for ranks in left.values())
    return kept + [{pos: left[pos][i] for pos in left} for i in range(assembled)]


def renumber(grid: Grid, replicas: Sequence[Dict[Position, int]]) -> Dict[int, int]:
    """Old rank -> new rank for the ranks of the kept replicas (in order)."""
    new_grid = grid.with_dp(len(replicas))
    return {old: new_grid.rank(tp, new_dp, pp)
            for new_dp, replica in enumerate(replicas)
            for (tp, pp), old in replica.items()}


def shard_sources(grid: Grid, kept: Set[int], reports: Dict[int, Report],
                  buddy: Sequence[int]) -> Tuple[Dict[int, List], List[str]]:
    """For every old rank, who contributes its shard: itself from its own
    snapshot if it stays (is in ``kept``), else its buddy from the held copy
    if the buddy stays. Returns (sources, problems)."""
    sources: Dict[int, List] = {}
    problems: List[str] = []
    for rank in range(grid.world_size):
        report = reports.get(rank)
        if rank in kept and report and report.own:
            sources[rank] = [rank, "own"]
        elif buddy[rank] in kept:
            sources[rank] = [buddy[rank], "held"]
        else:
            problems.append(f"rank {rank}'s optimizer shard has no copy on a kept rank "
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
    """Drop every replica that lost a rank; the rest, and the replicas its
    survivors make up, go on as a smaller job.

    members: old rank -> slot; reports: from every live rank."""
    broken = {grid.replica(r) for r in lost}
    replicas = kept_replicas(grid, lost)
    if not replicas:
        return abort(gen, f"no complete data-parallel replica is left: ranks "
                     f"{sorted(lost)} were lost from all {grid.dp} replicas, and some "
                     "(tp, pp) position has no rank left", members)
    if buddy is None:
        return abort(gen, f"ranks {sorted(lost)} were lost and no copy of their optimizer "
                     "shards exists (the job runs without a mirror)", members)
    mapping = renumber(grid, replicas)
    sources, problems = shard_sources(grid, set(mapping), reports, buddy)
    if problems:
        return abort(gen, "cannot shrink: " + "; ".join(problems), members)
    iteration = common_iteration(sources, reports)
    if iteration is None:
        return abort(gen, "cannot shrink: no iteration that every kept rank holds for every "
                     "shard", members)
    released = sorted(members[r] for r in members if r not in lost and r not in mapping)
    assembled = len(replicas) - (grid.dp - len(broken))
    return Decision(gen=gen, action="shrink", rollback_to=iteration,
                    members={new: members[old] for old, new in mapping.items()},
                    renumber=mapping, sources=sources, released=released,
                    old_dp=grid.dp, new_dp=len(replicas),
                    warnings=[f"shrinking from {grid.dp} to {len(replicas)} data-parallel "
                              f"replicas: dropped replica(s) {sorted(broken)}"
                              + (f", {assembled} made up of their surviving ranks"
                                 if assembled else "")])


def world_of(decision: Decision) -> dict:
    """The world after a shrink: its size and each rank's node (named as the
    buddy placement names nodes)."""
    return {"size": decision.world_size,
            "nodes": [f"node{parse_slot(decision.members[r])[0]}"
                      for r in range(decision.world_size)]}
