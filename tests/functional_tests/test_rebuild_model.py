"""The groups the group-rebuild time model (tools/planning/rebuild_cost.py)
is fed (tools/layout_probe.py --groups: megatron-core's own, in a fake world),
checked against the rank arithmetic of deadpool_ext/topology."""

import pytest

from tools.planning import rebuild_cost as rg
from deadpool_ext.state.mirror import MirrorGroups
from deadpool_ext.topology import Grid, buddy_map, dp_rings, nodes_by_block
from tools import scale_rebuild

pytestmark = pytest.mark.integration

TO_BUDDY, FROM_OWNER = MirrorGroups("to", "from").roles()


@pytest.fixture(scope="module")
def demo_groups():
    """megatron-core's groups of every rank of the demo's layout (8 ranks)."""
    return scale_rebuild.probe(scale_rebuild.DEMO.with_dp(2), 8, range(8))


def test_the_probe_reads_megatron_cores_groups(demo_groups):
    grid = Grid(2, 2, 2, tp_pp_dp=True)
    rings = dp_rings(8, 2, 2, tp_pp_dp=True)
    assert len({p["groups_created"] for p in demo_groups}) == 1  # every rank makes every group
    for found in demo_groups:
        rank, held = found["rank"], found["held"]
        tp, dp, pp = grid.coords(rank)
        assert held["_TENSOR_MODEL_PARALLEL_GROUP"] == [grid.rank(t, dp, pp) for t in range(2)]
        assert held["_PIPELINE_MODEL_PARALLEL_GROUP"] == [grid.rank(tp, dp, p) for p in range(2)]
        assert held["_DATA_PARALLEL_GROUP"] == next(r for r in rings if rank in r)
        assert held["WORLD"] == list(range(8))
        # DP 2: buddy and owner are one peer, so one pair group serves both.
        assert held[TO_BUDDY] == sorted([rank, (rank + 4) % 8])
        assert FROM_OWNER not in held
    # A hot swap of node 1 (ranks 4-7, replica 1): rank 0 keeps its tensor-
    # and pipeline-parallel groups, rebuilds those shared with replica 1.
    again = rg.rebuilt_roles(demo_groups[0]["held"], {4, 5, 6, 7})
    assert "_TENSOR_MODEL_PARALLEL_GROUP" not in again
    assert "_PIPELINE_MODEL_PARALLEL_GROUP" not in again
    assert {"_DATA_PARALLEL_GROUP", "WORLD", TO_BUDDY} <= set(again)


def test_the_mirror_connects_a_rank_to_its_buddy_and_its_owner_only():
    """DP 3 on three nodes: a ring of buddies, each rank in two pair groups
    (to its buddy on the next node, from its owner on the one before), and
    no group of the mirror's spans the job."""
    grid = Grid(2, 2, 3, tp_pp_dp=True)
    found = scale_rebuild.probe(grid, 12, range(12))
    buddies = buddy_map(12, 2, 2, nodes_by_block(12, 4), tp_pp_dp=True)
    for rank in found:
        r, held = rank["rank"], rank["held"]
        assert held[TO_BUDDY] == sorted([r, buddies.buddy[r]])
        assert held[FROM_OWNER] == sorted([buddies.owner[r], r])
        assert buddies.buddy[r] // 4 != r // 4  # on another node
    # Every rank took part in creating every group, the 12 pairs included.
    assert len({p["groups_created"] for p in found}) == 1
