"""Shrinking when spares run out (--deadpool-on-spares-exhausted shrink),
and growing back when a node joins: the pure parts, in-process (the
policy's plans, the sample quotas, the re-sharding arithmetic, a resized
world's config). The real runs (deadpool-launch with no spare node, ranks
SIGKILLed, a repaired node joining) and the shrink tolerance's reasoning
are in tests/functional_tests/test_shrink.py.
"""

import pytest
import torch

from deadpool_ext.config import DeadpoolConfig
from deadpool_ext.policy.decide import (
    grow,
    kept_replicas,
    renumber,
    replicas_to_add,
    shrink,
    whole_replica,
)
from deadpool_ext.policy.view import JobView, Limits
from deadpool_ext.protocol import Report
from deadpool_ext.rank.rebuild import world_config
from deadpool_ext.topology import Grid
from megatron.training.arguments import parse_args
from megatron.training.data import MicrobatchSampler, microbatches_per_iteration
from megatron.training.optimizer_layout import Bucket, full_state, new_shard


def limits(unit=1, sizes=None, **rest) -> Limits:
    return Limits(shrink_unit=unit, data_parallel_sizes=sizes and tuple(sizes), **rest)


def plan_shrink(gen, members, lost, reports, buddy, grid, unit=1, sizes=None, stop=False):
    """The policy's shrink of a job of ``grid`` that lost ``lost``."""
    view = JobView(
        gen=gen,
        members=members,
        lost=frozenset(lost),
        reports=reports,
        spares=(),
        buddy=tuple(buddy),
        owner=None,
        grid=grid,
        limits=limits(unit, sizes),
    )
    return shrink(view, stop=stop)


def plan_grow(gen, members, reports, spares, grid, planned_dp, sizes=None):
    """The policy's grow of a job of ``grid`` with ``spares`` ready."""
    view = JobView(
        gen=gen,
        members=members,
        lost=frozenset(),
        reports=reports,
        spares=tuple(spares),
        buddy=None,
        owner=None,
        grid=grid,
        planned_dp=planned_dp,
        limits=limits(sizes=sizes),
    )
    return grow(view)


# --- pure arithmetic -----------------------------------------------------------------


def reports(ranks, own=(2, 3), held=(2, 3)):
    return {r: Report(r, f"s{r}", list(own), list(held)) for r in ranks}


def test_an_moe_job_drops_whole_expert_parallel_blocks():
    """PP2 x DP4 with EP 2 in Megatron's default order: replicas 0, 1 and
    2, 3 each hold the 4 experts once. Losing rank 2 (replica 2) drops
    replicas 2 and 3; every kept rank keeps its expert-parallel rank (its
    new replica index modulo 2 is its old one), and none is made up."""
    grid = Grid(tp=1, pp=2, dp=4)  # rank = dp + 4 * pp
    kept = kept_replicas(grid, {2}, unit=2)
    assert kept == [whole_replica(grid, 0), whole_replica(grid, 1)]
    members = {r: f"{r // 2}.{r % 2}" for r in range(8)}
    buddy = [2, 3, 0, 1, 6, 7, 4, 5]  # shift 2: the same experts, another node
    d = plan_shrink(1, members, {2, 3}, reports([0, 1, 4, 5, 6, 7]), buddy, grid, unit=2)
    assert (d.old_dp, d.new_dp) == (4, 2)
    assert d.renumber == {0: 0, 1: 1, 4: 2, 5: 3}
    assert all(old % 2 == new % 2 for old, new in d.renumber.items())  # EP rank kept
    assert d.sources[2] == [0, "held"] and d.sources[6] == [4, "held"]
    assert sorted(d.released) == ["3.0", "3.1"]
    # Control: replica by replica, the survivors of replicas 2 and 3 would be
    # assembled into a replica that mixes expert-parallel ranks.
    assert len(kept_replicas(grid, {2, 7})) == 3


def test_renumber_keeps_positions_and_order():
    grid = Grid(tp=1, pp=2, dp=4, tp_pp_dp=True)  # rank = pp + 2 * dp
    kept = [whole_replica(grid, d) for d in (0, 1, 3)]
    assert renumber(grid, kept) == {0: 0, 1: 1, 2: 2, 3: 3, 6: 4, 7: 5}
    grid = Grid(tp=2, pp=2, dp=3)  # rank = tp + 2 * (dp + 3 * pp)
    mapping = renumber(grid, [whole_replica(grid, 0), whole_replica(grid, 2)])
    new = grid.with_dp(2)
    for old, new_rank in mapping.items():
        tp, dp, pp = grid.coords(old)
        assert new.coords(new_rank) == (tp, [0, 2].index(dp), pp)


def test_kept_replicas_are_the_intact_ones_then_those_survivors_make_up():
    grid = Grid(tp=1, pp=4, dp=2, tp_pp_dp=True)  # rank = pp + 4 * dp
    # One loss: the other replica goes on alone, as always.
    assert kept_replicas(grid, {2}) == [whole_replica(grid, 1)]
    # A loss in each replica, at different stages: one replica of survivors.
    assert kept_replicas(grid, {2, 4}) == [{(0, 0): 0, (0, 1): 1, (0, 2): 6, (0, 3): 3}]
    # The same stage lost in both: nothing can be made up.
    assert kept_replicas(grid, {2, 6}) == []
    grid = Grid(tp=1, pp=2, dp=4, tp_pp_dp=True)  # rank = pp + 2 * dp
    assert kept_replicas(grid, {1, 2, 5}) == [whole_replica(grid, 3), {(0, 0): 0, (0, 1): 3}]


def test_plan_shrink_drops_the_broken_replica_and_names_sources():
    grid = Grid(tp=1, pp=2, dp=4, tp_pp_dp=True)
    members = {r: f"{r // 4}.{r % 4}" for r in range(8)}
    buddy = [(r + 4) % 8 for r in range(8)]  # replica d -> replica d+2
    live = [r for r in range(8) if r != 5]
    d = plan_shrink(1, members, {5}, reports(live), buddy, grid)
    assert d.action == "shrink" and (d.old_dp, d.new_dp) == (4, 3)
    assert d.members == {0: "0.0", 1: "0.1", 2: "0.2", 3: "0.3", 4: "1.2", 5: "1.3"}
    assert d.released == ["1.0"]
    assert d.sources[5] == [1, "held"] and d.sources[4] == [0, "held"]
    assert d.sources[6] == [6, "own"] and d.rollback_to == 3


def test_an_interleaved_job_shrinks_to_a_size_its_schedule_runs_at():
    """PP2 x DP4 on the interleaved schedule, 8 microbatches per iteration:
    it runs at DP 1, 2 and 4 (shares of 8, 4, 2: multiples of PP 2), not at
    3 (shares 3, 3, 2). Losing rank 5 (replica 2) leaves replicas 0, 1, 3,
    and one more leaves: the last whose shards stay held by a kept rank."""
    grid = Grid(tp=1, pp=2, dp=4, tp_pp_dp=True)  # rank = pp + 2 * dp
    members = {r: f"{r // 4}.{r % 4}" for r in range(8)}
    live = [r for r in range(8) if r != 5]
    buddy = [(r + 4) % 8 for r in range(8)]  # replica d <-> replica d+2
    d = plan_shrink(1, members, {5}, reports(live), buddy, grid, sizes=[1, 2, 4])
    assert d.action == "shrink" and (d.old_dp, d.new_dp) == (4, 2)
    assert d.renumber == {0: 0, 1: 1, 2: 2, 3: 3}  # replica 3 leaves: replica 1 holds it
    assert d.sources[5] == [1, "held"] and d.sources[6] == [2, "held"]
    assert sorted(d.released) == ["1.0", "1.2", "1.3"]
    assert "1 more left for a size the interleaved schedule runs at" in d.warnings[0]
    # A ring (replica d's shards on replica d+1): replica 3 holds the lost
    # shards and replica 1 relies on replica 2, so replica 0 leaves.
    ring = [(r + 2) % 8 for r in range(8)]
    d = plan_shrink(1, members, {5}, reports(live), ring, grid, sizes=[1, 2, 4])
    assert (d.new_dp, d.renumber) == (2, {2: 0, 3: 1, 6: 2, 7: 3})
    assert d.sources[5] == [7, "held"] and d.sources[0] == [2, "held"]
    # Control: without the schedule's sizes the job goes on at DP 3.
    assert plan_shrink(1, members, {5}, reports(live), buddy, grid).new_dp == 3
    # No size fits: the job stops with the reason.
    d = plan_shrink(1, members, {5}, reports(live), buddy, grid, sizes=[4])
    assert d.action == "abort" and "data-parallel sizes [4] only" in d.reason


def test_an_interleaved_job_grows_only_to_a_size_its_schedule_runs_at():
    grid = Grid(tp=1, pp=2, dp=2)
    spares = [f"2.{i}" for i in range(4)]  # enough for DP 4
    assert replicas_to_add(grid, 4, spares) == 2
    assert replicas_to_add(grid, 4, spares, sizes=[1, 2, 4]) == 2
    assert replicas_to_add(grid, 4, spares[:2], sizes=[1, 2, 4]) == 0  # DP 3 does not run
    assert replicas_to_add(grid, 4, spares[:2]) == 1


def test_plan_shrink_refuses_when_no_replica_or_no_copy_is_left():
    grid = Grid(tp=1, pp=1, dp=2)
    members = {0: "0.0", 1: "1.0"}
    d = plan_shrink(1, members, {0, 1}, {}, [1, 0], grid)
    assert d.action == "abort" and "no complete data-parallel replica" in d.reason


def test_plan_shrink_makes_a_replica_of_the_survivors_of_two_broken_ones():
    """TP1 x PP4 x DP2: stage 2 of replica 0 and stage 0 of replica 1 are
    lost (a rank and a stuck survivor killed after it); stages 0, 1 and 3 of
    replica 0 and stage 2 of replica 1 train on, each lost shard coming from
    its buddy, every dropped survivor's from its buddy too."""
    grid = Grid(tp=1, pp=4, dp=2, tp_pp_dp=True)
    members = {r: f"{r // 4}.{r % 4}" for r in range(8)}
    buddy = [(r + 4) % 8 for r in range(8)]
    live = [r for r in range(8) if r not in (2, 4)]
    d = plan_shrink(2, members, {2, 4}, reports(live), buddy, grid)
    assert d.action == "shrink" and (d.old_dp, d.new_dp) == (2, 1)
    assert d.renumber == {0: 0, 1: 1, 6: 2, 3: 3}
    assert d.members == {0: "0.0", 1: "0.1", 2: "1.2", 3: "0.3"}
    assert d.released == ["1.1", "1.3"]
    assert d.sources == {
        0: [0, "own"],
        1: [1, "own"],
        2: [6, "held"],
        3: [3, "own"],
        4: [0, "held"],
        5: [1, "held"],
        6: [6, "own"],
        7: [3, "held"],
    }
    assert "1 made up of their surviving ranks" in d.warnings[0]
    grid = Grid(tp=1, pp=1, dp=3)
    members = {r: f"{r}.0" for r in range(3)}
    # rank 1's copy is on rank 2, whose replica also broke
    d = plan_shrink(1, members, {1, 2}, reports([0]), [1, 2, 0], grid)
    assert d.action == "abort" and "rank 1's optimizer shard has no copy" in d.reason
    d = plan_shrink(1, members, {1}, reports([0, 2], own=(4,), held=(3,)), [1, 2, 0], grid)
    assert d.action == "abort" and "no iteration" in d.reason


def test_plan_grow_appends_whole_replicas_from_spares_in_node_order():
    grid = Grid(tp=2, pp=2, dp=1)  # rank = tp + 2 * (dp + 1 * pp)
    members = {0: "0.0", 1: "0.1", 2: "0.2", 3: "0.3"}
    spares = ["2.1", "1.0", "2.0", "1.3", "1.1", "1.2", "2.2"]  # 7: one replica of 4
    d = plan_grow(5, members, reports(range(4), own=(7, 6)), spares, grid, planned_dp=4)
    assert d.action == "grow" and (d.old_dp, d.new_dp) == (1, 2) and d.rollback_to == 7
    new = grid.with_dp(2)  # rank = tp + 2 * (dp + 2 * pp)
    assert d.renumber == {0: 0, 1: 1, 2: 4, 3: 5}
    # The new replica's TP pairs are consecutive slots of node 1.
    assert d.replaced == {
        new.rank(0, 1, 0): "1.0",
        new.rank(1, 1, 0): "1.1",
        new.rank(0, 1, 1): "1.2",
        new.rank(1, 1, 1): "1.3",
    }
    assert d.world_size == 8 and set(d.members.values()) == set(members.values()) | {
        "1.0",
        "1.1",
        "1.2",
        "1.3",
    }
    assert all(d.sources[r] == [r, "own"] for r in range(4))


def test_plan_grow_stops_at_the_launched_size_and_needs_a_common_snapshot():
    grid = Grid(tp=1, pp=1, dp=2)
    members = {0: "0.0", 1: "0.1"}
    d = plan_grow(3, members, reports([0, 1]), ["1.0", "1.1", "1.2"], grid, planned_dp=3)
    assert d.new_dp == 3 and d.replaced == {2: "1.0"}
    d = plan_grow(3, members, reports([0, 1]), [], grid, planned_dp=3)
    assert d.action == "recover" and d.members == members and d.rollback_to == 3
    lagging = {0: Report(0, "0.0", [5], []), 1: Report(1, "0.1", [4], [])}
    d = plan_grow(3, members, lagging, ["1.0"], grid, planned_dp=3)
    assert d.action == "abort" and "no snapshot iteration" in d.reason


@pytest.mark.parametrize("gbs, mbs, dp", [(8, 2, 3), (32, 4, 3), (24, 2, 5), (8, 2, 4), (6, 1, 4)])
def test_quotas_cover_every_sample_of_every_iteration_once(gbs, mbs, dp):
    quotas = [microbatches_per_iteration(gbs, mbs, r, dp) for r in range(dp)]
    assert sum(quotas) == gbs // mbs and max(quotas) - min(quotas) <= 1
    total = 5 * gbs
    samplers = [list(MicrobatchSampler(total, gbs, mbs, r, dp, gbs)) for r in range(dp)]
    for it in range(4):
        seen = sorted(
            i
            for r in range(dp)
            for mb in samplers[r][it * quotas[r] : (it + 1) * quotas[r]]
            for i in mb
        )
        assert seen == list(range(gbs * (it + 1), gbs * (it + 2)))


def test_sampler_with_global_batch_is_megatrons_order_when_dp_divides():
    for r in range(2):
        assert list(MicrobatchSampler(64, 16, 2, r, 2, 16)) == list(
            MicrobatchSampler(64, 16, 2, r, 2)
        )


def test_a_resized_world_config_keeps_the_launched_size_and_leaves_the_old_one_alone():
    config = parse_args(
        ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
        + ["--seq-length", "32", "--micro-batch-size", "1", "--train-iters", "10"]
        + ["--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer"]
        + ["--vocab-size", "100", "--deadpool", "--use-distributed-optimizer"],
        extra_sections={"deadpool": DeadpoolConfig},
        world_size=8,
    )
    assert world_config(config, None) is config
    shrunk = world_config(config, {"size": 6, "nodes": ["node0"] * 4 + ["node2"] * 2})
    assert (shrunk.world_size, shrunk.planned_world_size) == (6, 8)
    assert shrunk.world.rank_nodes == ["node0"] * 4 + ["node2"] * 2
    assert shrunk.section(DeadpoolConfig).deadpool_allow_same_node_buddy
    shrunk.run.padded_vocab_size = 128  # its trainer's, not the old world's
    assert config.run.padded_vocab_size is None and config.world.rank_nodes is None
    assert not config.section(DeadpoolConfig).deadpool_allow_same_node_buddy
    again = world_config(shrunk, {"size": 4, "nodes": ["node0"] * 4})
    assert (again.world_size, again.planned_world_size) == (4, 8)


def test_reshard_round_trip_between_dp_sizes():
    """Shards of a DP=3 layout -> per-parameter state -> DP=2 shards -> back."""
    torch.manual_seed(0)
    params = {"a": torch.randn(3, 7), "b": torch.randn(5), "c": torch.randn(4, 4)}

    def layout(dp):  # one bucket, parameters at padded offsets, size divisible by dp
        places, offset = {}, 0
        for name, value in params.items():
            places[name] = (offset, value.numel())
            offset += -(-value.numel() // 8) * 8
        return [Bucket(-(-offset // (8 * dp)) * 8 * dp, places)]

    def shards(dp):
        bucket = layout(dp)[0]
        flat = [torch.zeros(bucket.numel) for _ in range(3)]
        for name, (start, numel) in bucket.params.items():
            for k in range(3):
                flat[k][start : start + numel] = params[name].view(-1) * (k + 1)
        size = bucket.numel // dp
        return [[f[r * size : (r + 1) * size] for f in flat] for r in range(dp)]

    state = full_state(layout(3), shards(3))
    for name, value in params.items():
        for k in range(3):
            assert torch.equal(state[name][k], value.view(-1) * (k + 1))
    for r in range(2):
        got = new_shard(layout(2), state, r, 2)
        assert all(torch.equal(g, w) for g, w in zip(got, shards(2)[r]))


def test_expert_buckets_are_cut_over_the_expert_data_parallel_group():
    """A dense bucket sliced over DP 4 and an expert bucket over expert-DP
    2: the full state takes each from its own shards, and the new shards
    (DP 2, expert-DP 1) slice each by its own size."""
    dense = Bucket(8, {"w": (0, 6)})
    expert = Bucket(4, {"local_experts.0.w": (0, 3)}, expert=True)
    w, e = torch.arange(6.0), torch.arange(10.0, 13.0)

    def padded(values, numel):
        return torch.cat([values, torch.zeros(numel - values.numel())])

    flat_w, flat_e = padded(w, 8), padded(e, 4)
    # rank k's regions: its dense slice (2 of 8), then its expert slice (2 of 4)
    shards = [[torch.cat([flat_w[2 * k : 2 * k + 2], flat_e[:2]])] * 3 for k in range(4)]
    experts = [[torch.cat([flat_w[0:2], flat_e[2 * k : 2 * k + 2]])] * 3 for k in range(2)]
    state = full_state([dense, expert], shards, experts)
    assert torch.equal(state["w"][0], w) and torch.equal(state["local_experts.0.w"][0], e)
    got = new_shard([dense, expert], state, 1, 2, expert_slice=(0, 1))
    assert torch.equal(got[0], torch.cat([flat_w[4:8], flat_e]))
    # Control: sliced over DP like the dense bucket, the expert state is torn.
    torn = full_state([dense, Bucket(4, expert.params)], shards)
    assert not torch.equal(torn["local_experts.0.w"][0], e)
