"""Buddy layout tables: pure rank arithmetic, no processes."""

import pytest
from megatron.core.parallel_state import RankGenerator

from deadpool_ext.topology import (
    BuddyError,
    Experts,
    Grid,
    buddy_map,
    dp_rings,
    expert_dp_groups,
    nodes_by_block,
)


@pytest.mark.parametrize(
    "world,tp,pp,tp_pp_dp",
    [
        (8, 2, 2, False),
        (8, 2, 2, True),
        (16, 4, 2, False),
        (16, 4, 2, True),
        (12, 1, 3, False),
        (12, 1, 3, True),
        (8, 1, 1, False),
    ],
)
def test_rings_are_megatrons_data_parallel_groups(world, tp, pp, tp_pp_dp):
    order = "tp-cp-ep-pp-dp" if tp_pp_dp else "tp-cp-ep-dp-pp"
    generator = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=order)
    assert sorted(dp_rings(world, tp, pp, tp_pp_dp)) == sorted(generator.get_ranks("dp"))


@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (4, 2, 3), (1, 3, 4), (2, 1, 2)])
@pytest.mark.parametrize("tp_pp_dp", [False, True])
def test_the_grid_is_megatrons_rank_order_both_ways(tp, pp, dp, tp_pp_dp):
    """Grid.rank and Grid.coords (what the policy and the restore use) agree
    with megatron-core's RankGenerator for every rank."""
    order = "tp-cp-ep-pp-dp" if tp_pp_dp else "tp-cp-ep-dp-pp"
    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order)
    grid = Grid(tp, pp, dp, tp_pp_dp)
    for group in generator.get_ranks("dp"):
        assert len({grid.coords(r)[0::2] for r in group}) == 1  # one (tp, pp) position
        assert [grid.coords(r)[1] for r in group] == list(range(dp))
    for group in generator.get_ranks("tp"):
        assert [grid.coords(r)[0] for r in group] == list(range(tp))
    for rank in range(tp * pp * dp):
        assert grid.rank(*grid.coords(rank)) == rank


def check_layout(layout, world, node_of):
    """Each rank sends to one buddy on another node and holds one mirror."""
    assert sorted(layout.buddy) == list(range(world))
    assert sorted(layout.buddy.values()) == list(range(world))  # a permutation
    for rank, buddy in layout.buddy.items():
        assert buddy != rank
        assert node_of[buddy] != node_of[rank]
        assert layout.owner[buddy] == rank


# Perlmutter: 4 A100 per node. TP=4 inside the node, PP and DP across nodes.
PERLMUTTER = [
    # world, tp, pp, expected buddy of rank 0, shift
    (16, 4, 2, 4, 1),  # 4 nodes: DP=2, rank 0's DP peer is rank 4 (node 1)
    (32, 4, 2, 4, 1),  # DP=4
    (512, 4, 8, 4, 1),  # the paper's 65B-class run: 128 nodes, DP=16
]


@pytest.mark.parametrize("world,tp,pp,buddy0,shift", PERLMUTTER)
def test_perlmutter_layouts(world, tp, pp, buddy0, shift):
    node_of = nodes_by_block(world, 4)
    layout = buddy_map(world, tp, pp, node_of)
    check_layout(layout, world, node_of)
    assert layout.buddy[0] == buddy0 and layout.shift == shift and not layout.same_node


def test_perlmutter_tp2_dp_inside_node_moves_to_next_node():
    """TP=2 leaves two DP peers per node: the shift skips the node-mate."""
    node_of = nodes_by_block(16, 4)
    layout = buddy_map(16, 2, 1, node_of)  # DP=8, ring 0,2,4,...,14
    check_layout(layout, 16, node_of)
    assert layout.shift == 2 and layout.buddy[0] == 4


def test_demo_layout_needs_tp_pp_dp_mapping():
    """TP2·PP2·DP2 on two 4-rank nodes: Megatron's default order keeps DP
    peers on one node; tp-pp-dp puts each replica on its own node."""
    node_of = nodes_by_block(8, 4)
    with pytest.raises(BuddyError, match="--use-tp-pp-dp-mapping"):
        buddy_map(8, 2, 2, node_of)
    layout = buddy_map(8, 2, 2, node_of, tp_pp_dp=True)
    check_layout(layout, 8, node_of)
    assert layout.buddy == {0: 4, 1: 5, 2: 6, 3: 7, 4: 0, 5: 1, 6: 2, 7: 3}


# Vista: one GH200 per node; every rank is its own node.
@pytest.mark.parametrize("world,tp,pp", [(8, 1, 2), (16, 1, 4), (600, 1, 8), (4, 1, 1)])
def test_vista_layouts(world, tp, pp):
    node_of = nodes_by_block(world, 1)
    layout = buddy_map(world, tp, pp, node_of)
    check_layout(layout, world, node_of)
    assert layout.shift == 1


def test_one_node_is_refused_with_the_reason():
    with pytest.raises(BuddyError, match="another node.*--deadpool-allow-same-node-buddy"):
        buddy_map(4, 1, 1, nodes_by_block(4, 4))


def test_one_node_accepted_when_asked():
    layout = buddy_map(4, 1, 1, nodes_by_block(4, 4), allow_same_node=True)
    assert layout.same_node and layout.buddy == {0: 1, 1: 2, 2: 3, 3: 0}


def test_dp_one_is_refused_with_the_reason():
    with pytest.raises(BuddyError, match="data-parallel size >= 2"):
        buddy_map(8, 4, 2, nodes_by_block(8, 4))


def test_uneven_nodes_use_the_smallest_working_shift():
    """Three nodes of 2, 1 and 1 ranks (DP=4, TP=PP=1): shift 1 would pair
    the two ranks of node a; shift 2 does not."""
    node_of = ["a", "a", "b", "c"]
    layout = buddy_map(4, 1, 1, node_of)
    check_layout(layout, 4, node_of)
    assert layout.shift == 2


# ----- MoE: expert shards are sharded over the expert-data-parallel group -----
EXPERT_LAYOUTS = [  # world, tp, pp, expert TP, EP, --use-tp-pp-dp-mapping
    (8, 1, 2, 1, 2, False),
    (8, 2, 1, 1, 2, False),
    (16, 2, 2, 2, 2, False),
    (16, 2, 2, 1, 4, False),
    (16, 2, 2, 1, 2, True),
    (8, 1, 1, 1, 2, True),
]


@pytest.mark.parametrize("world,tp,pp,etp,ep,tp_pp_dp", EXPERT_LAYOUTS)
def test_expert_data_parallel_groups_are_megatrons(world, tp, pp, etp, ep, tp_pp_dp):
    order = "tp-cp-ep-pp-dp" if tp_pp_dp else "tp-cp-ep-dp-pp"
    generator = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    groups = {}
    for rank, key in enumerate(expert_dp_groups(world, Experts(etp, ep), pp, tp_pp_dp)):
        groups.setdefault(key, []).append(rank)
    assert sorted(groups.values()) == sorted(generator.get_ranks("dp"))


@pytest.mark.parametrize("world,tp,pp,etp,ep,tp_pp_dp", EXPERT_LAYOUTS)
def test_an_expert_shards_buddy_holds_the_same_experts_on_another_node(
    world, tp, pp, etp, ep, tp_pp_dp
):
    node_of = nodes_by_block(world, 2)
    layout = buddy_map(world, tp, pp, node_of, tp_pp_dp=tp_pp_dp, experts=Experts(etp, ep))
    check_layout(layout, world, node_of)
    group_of = expert_dp_groups(world, Experts(etp, ep), pp, tp_pp_dp)
    assert not layout.experts_apart
    assert all(group_of[r] == group_of[b] for r, b in layout.buddy.items())


def test_the_dense_buddy_would_hold_other_experts():
    """Control: without the expert constraint the smallest shift pairs
    ranks of different expert-parallel ranks (8 ranks, PP2, DP4, EP2, a
    node per rank)."""
    node_of = nodes_by_block(8, 1)
    dense = buddy_map(8, 1, 2, node_of)
    moe = buddy_map(8, 1, 2, node_of, experts=Experts(1, 2))
    group_of = expert_dp_groups(8, Experts(1, 2), 2)
    assert dense.shift == 1 and group_of[0] != group_of[dense.buddy[0]]
    assert moe.shift == 2 and group_of[0] == group_of[moe.buddy[0]]


def test_experts_with_no_data_parallel_copy_mirror_to_any_peer():
    """EP = DP (expert-DP 1): no peer holds the same experts; a DP peer on
    another node still holds the snapshot (enough for a hot swap), and the
    map says the experts lie apart (a shrink cannot re-cut them)."""
    layout = buddy_map(8, 1, 2, nodes_by_block(8, 2), experts=Experts(1, 4))
    check_layout(layout, 8, nodes_by_block(8, 2))
    assert layout.experts_apart
    assert not buddy_map(8, 1, 2, nodes_by_block(8, 2), experts=Experts(1, 2)).experts_apart
