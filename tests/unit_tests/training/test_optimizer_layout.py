"""The distributed optimizer's shards re-cut for another data-parallel size
(megatron/training/optimizer_layout.py), in-process: a round trip between
sizes, and expert buckets cut over the expert data-parallel group."""

import torch

from megatron.training.optimizer_layout import Bucket, full_state, new_shard


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
