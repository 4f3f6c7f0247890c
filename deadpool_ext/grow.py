"""Growing back after a shrink, as pure rank arithmetic.

When the ready spare slots make up whole data-parallel replicas again (a
repaired or new node registered with ``deadpool-launch --join``, or the
ranks that shrinks released add up), the job grows at an iteration
boundary, never past the size it was launched with. The running replicas
keep their order and (tp, pp) positions; the new replicas come after them,
each taking spare slots in node order, so its tensor-parallel group stays
on one node where the slots allow. Nobody was lost: every shard comes from
its owner's own snapshot, and everyone resumes from the newest snapshot all
ranks hold (the boundary itself, or one iteration before it when a rank's
snapshot of the boundary was still in flight).
"""

from typing import Dict, Sequence

from deadpool_ext.control import parse_slot
from deadpool_ext.plan import Decision, Report, abort
from deadpool_ext.shrink import Grid, common_iteration


def replicas_to_add(grid: Grid, planned_dp: int, spares: Sequence[str]) -> int:
    """Whole replicas the spares can fill, up to the planned size."""
    return max(0, min(planned_dp - grid.dp, len(spares) // (grid.tp * grid.pp)))


def place_new_replicas(grid: Grid, new_grid: Grid, spares: Sequence[str]) -> Dict[int, str]:
    """New rank -> spare slot for the replicas grid.dp .. new_grid.dp - 1.
    TP is innermost in the rank order, so consecutive slots of a node make
    up a TP group."""
    free = iter(sorted(spares, key=parse_slot))
    return {new_grid.rank(tp, dp, pp): next(free)
            for dp in range(grid.dp, new_grid.dp)
            for pp in range(grid.pp) for tp in range(grid.tp)}


def plan_grow(gen: int, members: Dict[int, str], reports: Dict[int, Report],
              spares: Sequence[str], grid: Grid, planned_dp: int) -> Decision:
    """members: rank -> slot of the running job; reports: from all of them."""
    sources = {rank: [rank, "own"] for rank in members}
    iteration = common_iteration(sources, reports)
    if iteration is None:
        return abort(gen, "cannot grow: no snapshot iteration every rank holds: "
                     f"{ {r: rep.own for r, rep in sorted(reports.items())} }", members)
    add = replicas_to_add(grid, planned_dp, spares)
    if add == 0:
        # The spares left between the announcement and now: go on as before.
        return Decision(gen=gen, action="recover", rollback_to=iteration, members=dict(members),
                        warnings=["the spares for the grow are gone; the job goes on at "
                                  f"{grid.dp} data-parallel replicas"])
    new_grid = grid.with_dp(grid.dp + add)
    mapping = {rank: new_grid.rank(*grid.coords(rank)) for rank in members}
    joined = place_new_replicas(grid, new_grid, spares)
    new_members = {mapping[rank]: slot for rank, slot in members.items()}
    new_members.update(joined)
    return Decision(gen=gen, action="grow", rollback_to=iteration, members=new_members,
                    replaced=joined, renumber=mapping, sources=sources,
                    old_dp=grid.dp, new_dp=new_grid.dp,
                    warnings=[f"growing from {grid.dp} to {new_grid.dp} data-parallel "
                              f"replicas with spare slots {sorted(joined.values())}"])
