"""The snapshot format without processes: what verify() accepts and refuses."""

import pytest
import torch

from deadpool_ext.state import snapshot as snap


def sealed(iteration=7, owner=3, numel=10_000):
    layout = snap.ShardLayout([], numel, 4096)
    buffer = snap.allocate(layout)
    generator = torch.Generator().manual_seed(0)
    for region in snap.regions(buffer, layout):
        region.copy_(torch.randn(numel, generator=generator))
    side = {"steps": [float(iteration)] * 3, "progress": {"iteration": iteration}}
    snap.seal(buffer, layout, iteration, owner, snap.encode_sidecar(side))
    return layout, buffer


def test_a_sealed_snapshot_verifies_and_reads_back():
    layout, buffer = sealed()
    assert layout.nbytes % (snap.CHUNK_WORDS * 8) == 0
    assert snap.verify(buffer, layout, iteration=7, owner=3) == 7
    assert snap.read_sidecar(buffer, layout)["progress"] == {"iteration": 7}


@pytest.mark.parametrize(
    "byte",
    [
        snap.HEADER_BYTES + 5,
        snap.HEADER_BYTES + 60_000,
        -1,
        snap.HEADER_BYTES + 3 * 10_000 * 4 + 10,
    ],
)
def test_any_flipped_bit_is_detected(byte):
    layout, buffer = sealed()
    buffer[byte] ^= 1
    with pytest.raises(snap.SnapshotError, match="checksum"):
        snap.verify(buffer, layout)


def test_swapped_chunks_are_detected():
    layout, buffer = sealed(numel=40_000)
    words = buffer.view(torch.int64).view(-1, snap.CHUNK_WORDS)
    words[[1, 2]] = words[[2, 1]].clone()
    with pytest.raises(snap.SnapshotError, match="checksum"):
        snap.verify(buffer, layout)


def _swap_words(words, i, j):
    words[[i, j]] = words[[j, i]].clone()


def _plus_minus(words, i, j):
    words[i] += 12345
    words[j] -= 12345


def _two_sign_bits(words, i, j):
    words[i] ^= -(1 << 63)  # bit 63 of an int64
    words[j] ^= -(1 << 63)


@pytest.mark.parametrize("corrupt", [_swap_words, _plus_minus, _two_sign_bits])
def test_structured_corruptions_within_one_chunk_are_detected(corrupt):
    """What the weighted word sum this checksum replaced did not see
    (../shared/reliability-probes/checksum_blind.py)."""
    layout, buffer = sealed(numel=40_000)
    words = buffer.view(torch.int64)
    first = snap.HEADER_BYTES // 8 + 100  # two words of one 32 KiB chunk
    corrupt(words, first, first + 7)
    with pytest.raises(snap.SnapshotError, match="checksum"):
        snap.verify(buffer, layout)


def test_the_old_weighted_sum_was_blind_to_them():
    """Control: the same corruptions leave the weighted word sum (still used
    for buffers in GPU memory) unchanged, so the test above can fail."""
    for corrupt in (_swap_words, _plus_minus, _two_sign_bits):
        _, buffer = sealed(numel=40_000)
        before = snap._weighted_sum(buffer)
        first = snap.HEADER_BYTES // 8 + 100
        corrupt(buffer.view(torch.int64), first, first + 7)
        assert snap._weighted_sum(buffer) == before


def test_torn_wrong_iteration_wrong_owner_and_wrong_layout():
    layout, buffer = sealed()
    with pytest.raises(snap.SnapshotError, match="iteration 7"):
        snap.verify(buffer, layout, iteration=8)
    with pytest.raises(snap.SnapshotError, match="rank 3"):
        snap.verify(buffer, layout, owner=2)
    with pytest.raises(snap.SnapshotError, match="elements"):
        snap.verify(buffer, snap.ShardLayout([], 9_999, 4096))
    with pytest.raises(snap.SnapshotError, match="magic"):
        snap.verify(snap.allocate(layout), layout)


def test_an_oversized_sidecar_is_refused():
    layout = snap.ShardLayout([], 100, 16)
    with pytest.raises(snap.SnapshotError, match="sidecar"):
        snap.seal(snap.allocate(layout), layout, 0, 0, b"x" * 17)


class DistributedOptimizer:
    """What the snapshot reads of megatron-core's: its inner optimizer and
    where each model parameter's main parameter is (group, place)."""

    def __init__(self, adam, places):
        self.optimizer, self.model_param_group_index_map = adam, places


@pytest.mark.parametrize("per_parameter", [True, False], ids=["torch-adam", "fused-adam"])
def test_the_shard_and_adams_step_come_back_where_the_optimizer_keeps_them(per_parameter):
    """torch's Adam keeps its step per parameter; Apex's and Transformer
    Engine's FusedAdam per group (test_replay.GroupStepAdamW keeps it so)."""
    from tests.unit_tests.state.test_replay import GroupStepAdamW

    cls = torch.optim.AdamW if per_parameter else GroupStepAdamW
    sizes, model_params = [5, 3], [torch.nn.Parameter(torch.zeros(1)) for _ in range(2)]
    layout = snap.ShardLayout(
        [snap.Segment(0, model_params[0], 0, 5), snap.Segment(0, model_params[1], 8, 3)], 16, 4096
    )

    def optimizer():
        params = [torch.nn.Parameter(torch.arange(n, dtype=torch.float32)) for n in sizes]
        adam = cls([{"params": params[:1]}, {"params": params[1:]}])
        return DistributedOptimizer(adam, {model_params[0]: (0, 0), model_params[1]: (1, 0)})

    trained = optimizer()
    for _ in range(3):
        for group in trained.optimizer.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        trained.optimizer.step()
    buffer = snap.allocate(layout)
    steps = snap.pack_shard(trained, layout, buffer)
    assert steps == [3.0, 3.0]
    fresh = optimizer()
    snap.unpack_shard(fresh, layout, buffer, steps)
    for got, want in zip(fresh.optimizer.param_groups, trained.optimizer.param_groups):
        assert ("step" in got) == (not per_parameter) and got.get("step") == want.get("step")
        for p, q in zip(got["params"], want["params"]):
            assert torch.equal(p, q)
            for name in ("exp_avg", "exp_avg_sq") + (("step",) if per_parameter else ()):
                assert torch.equal(fresh.optimizer.state[p][name], trained.optimizer.state[q][name])
