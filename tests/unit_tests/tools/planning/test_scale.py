"""The scale planner (tools/planning/scale.py) in-process, against our own
code: the sizes real runs logged (docs/benchmarks.md), its constants are
deadpool_ext's, and memory terms against their published closed forms. Its
command line is tests/unit_tests/tools/test_plan_scale.py's; the snapshot
sizes against the layouts megatron-core builds for real models are in
tests/functional_tests/test_plan_scale.py."""

from dataclasses import replace

import pytest

from tools.planning import recipes
from tools.planning import scale as ps
from tools.bench.common import LARGE_MODEL

RUN = ["--train-iters", "1", "--lr", "1e-3"]
# LLaMA-style, with every option that changes the tensors or the padding:
# SwiGLU, RMSNorm, grouped-query attention, no biases, untied output layer,
# rotary positions, bf16, a vocabulary that needs padding, DP = 3.
LLAMA = ps.ModelShape(
    "llama",
    4,
    64,
    4,
    176,
    1000,
    32,
    num_query_groups=2,
    swiglu=True,
    normalization="RMSNorm",
    add_bias_linear=False,
    position_embedding="rope",
    tied_embeddings=False,
)
LLAMA_LAYOUT = ps.Parallel(2, 2, 3, global_batch=6, precision="bf16")
# Mixtral-style MoE: SwiGLU experts narrower than the dense MLP, EP 2 over
# DP 4 (expert-DP 2), PP 2 with a first stage holding the embedding.
MOE = ps.ModelShape(
    "moe",
    4,
    64,
    4,
    256,
    512,
    32,
    swiglu=True,
    normalization="RMSNorm",
    add_bias_linear=False,
    num_experts=4,
    moe_ffn_hidden_size=96,
)
MOE_LAYOUT = ps.Parallel(1, 2, 4, global_batch=8, precision="fp32", ep=2)

CASES = {
    # name: (flags, world, vocabulary, planner shape, planner layout, rank -> stage)
    "demo": (
        recipes.DEMO.model_flags() + ["--use-tp-pp-dp-mapping"] + RUN,
        8,
        512,
        recipes.DEMO.shape,
        recipes.DEMO.layout,
        lambda r: (r // 2) % 2,
    ),
    # The benchmarks' large configuration, as they run it.
    "large": (
        LARGE_MODEL + RUN,
        2,
        512,
        ps.ModelShape("large", 6, 512, 8, 2048, 512, 512),
        ps.Parallel(1, 1, 2),
        lambda r: 0,
    ),
    "llama": (
        recipes.model_flags(LLAMA, LLAMA_LAYOUT) + ["--bf16"] + RUN,
        12,
        1000,
        LLAMA,
        LLAMA_LAYOUT,
        lambda r: r // 6,
    ),
    "moe": (
        recipes.model_flags(MOE, MOE_LAYOUT) + RUN,
        8,
        512,
        MOE,
        MOE_LAYOUT,
        lambda r: r // 4,
    ),
}


def test_planner_reproduces_the_sizes_real_runs_logged():
    """docs/benchmarks.md (issue 3), from the runs' mirror_ready events: demo
    1.7 MB sent and 6.8 MB extra per rank; large 111.5 MB and 446 MB (MiB)."""
    for case, sent, extra in (("demo", 1.7, 6.8), ("large", 111.5, 446.0)):
        _, _, _, shape, par, _ = CASES[case]
        largest = max(
            (ps.rank_layout(shape, par, s) for s in range(par.pp)),
            key=lambda layout: layout.snapshot_bytes,
        )
        assert round(largest.snapshot_bytes / ps.MiB, 1) == sent
        assert round(largest.mirror_bytes / ps.MiB, 1) == extra


def test_snapshot_constants_follow_deadpool_ext():
    from deadpool_ext.state import snapshot as snap

    assert ps.HEADER_BYTES == snap.HEADER_BYTES and ps.CHUNK_BYTES == snap.CHUNK_WORDS * 8
    assert ps.SNAPSHOT_BYTES_PER_ELEMENT == 4 * len(snap.STATES)
    for numel, tensors in ((1, 1), (123_457, 26), (10_000_000, 300)):
        layout = snap.ShardLayout([], numel, ps.SIDECAR_BASE + ps.SIDECAR_PER_PARAM * tensors)
        assert ps.snapshot_bytes(numel, tensors) == layout.nbytes
    layout = snap.ShardLayout([], 5000, 4096)
    assert mirror_buffer_bytes(layout, "state") == ps.MIRROR_BUFFERS * layout.nbytes


def mirror_buffer_bytes(layout, mode: str) -> int:
    """What a Mirror of this layout allocates (rank 0 mirroring to rank 1)."""
    import torch

    from deadpool_ext.state.mirror import Mirror, MirrorGroups

    groups = MirrorGroups(None, None)
    mirror = Mirror(None, layout, rank=0, buddy=1, owner=1, groups=groups, events=None, mode=mode)
    mirror.allocate("cpu")
    try:
        assert all(b.dtype == torch.uint8 for b in mirror.own + mirror.held)
        return mirror.extra_bytes
    finally:
        mirror.close()


def test_grad_mode_constants_follow_deadpool_ext():
    """The planner's packet and grad-mode buffers are the replay's and the
    mirror's, and its mode names and default are the flag's."""
    from deadpool_ext.config import DeadpoolConfig
    from deadpool_ext.state import replay
    from deadpool_ext.state import snapshot as snap

    assert ps.PACKET_BYTES_PER_ELEMENT == 4
    for numel, tensors in ((1, 1), (123_457, 26), (10_000_000, 300)):
        layout = snap.ShardLayout([], numel, ps.SIDECAR_BASE + ps.SIDECAR_PER_PARAM * tensors)
        assert ps.packet_bytes(numel, tensors) == replay.packet_bytes(layout)
    numel, tensors = 5000, 3
    layout = snap.ShardLayout([], numel, ps.SIDECAR_BASE + ps.SIDECAR_PER_PARAM * tensors)
    planned = ps.Layout(tensors, numel, numel, numel, layout.nbytes, replay.packet_bytes(layout))
    assert mirror_buffer_bytes(layout, "grad") == planned.mirror_bytes
    default = DeadpoolConfig()
    assert ps.Parallel(1, 1, 1).mirror_mode == default.deadpool_mirror_mode
    flag = DeadpoolConfig.__dataclass_fields__["deadpool_mirror_mode"]
    assert tuple(flag.metadata["choices"]) == ps.MIRROR_MODES


def test_grad_mode_sends_a_third_and_keeps_two_packets_more():
    shape, par = ps.MODELS["llama-65b"], ps.paper_layouts(512)["llama-65b"]
    hw = ps.HARDWARE["perlmutter-a100-40"]
    grad = replace(par, mirror_mode="grad")
    state, replayed = ps.rank_layout(shape, par, 0), ps.rank_layout(shape, grad, 0)
    assert (state.packet_bytes, state.sent_bytes) == (0, state.snapshot_bytes)
    assert replayed.snapshot_bytes == state.snapshot_bytes
    assert replayed.sent_bytes == replayed.packet_bytes
    assert replayed.sent_bytes / state.sent_bytes == pytest.approx(1 / 3, rel=0.01)
    assert replayed.mirror_bytes == state.mirror_bytes + 2 * replayed.packet_bytes
    slow, fast = ps.mirror_time(shape, par, hw, 0.45), ps.mirror_time(shape, grad, hw, 0.45, True)
    assert fast.link == pytest.approx(replayed.packet_bytes / 25e9)
    assert fast.link == pytest.approx(slow.link / 3, rel=0.01) and fast.copy == 0
    assert fast.cpu == slow.cpu  # both seal a whole snapshot and check one
    with pytest.raises(ValueError, match="one of state, grad"):
        ps.rank_layout(shape, replace(par, mirror_mode="full"), 0)


def test_buckets_split_at_the_bucket_size_and_around_a_shared_embedding():
    tensors = [ps.Tensor("a", 100), ps.Tensor("b", 200), ps.Tensor("c", 300)]
    # Reverse order: c closes the first bucket (300 >= 250, padded to 384);
    # b then a (a starts at 640, a multiple of 64) close the second at 768.
    assert ps.bucket_sizes(tensors, dp=2, bucket_size=250) == [384, 384]
    assert ps.bucket_sizes(tensors, dp=2) == [768]
    assert ps.bucket_sizes(tensors, dp=3) == [768]  # lcm(3, 128) = 384
    shared = [ps.Tensor("emb", 1000, shared_embedding=True)] + tensors[:2]
    assert ps.bucket_sizes(shared, dp=2) == [384, 1024]


def test_bf16_and_fp32_bytes_per_parameter_follow_megatrons_formulas():
    """Megatron's distributed optimizer: 6 + 12/d bytes per parameter with
    bf16 params and fp32 gradients, 8 + 8/d with fp32 (no padding here)."""
    shape = ps.ModelShape("even", 2, 256, 4, 1024, 512, 256, tied_embeddings=True)
    for precision, expected in (("bf16", lambda d: 6 + 12 / d), ("fp32", lambda d: 8 + 8 / d)):
        for dp in (1, 2, 8):
            par = ps.Parallel(1, 1, dp, precision=precision)
            layout = ps.rank_layout(shape, par, 0)
            assert layout.buffer_numel == layout.params  # nothing padded
            total = sum(ps.state_bytes(layout, par).values())
            assert total / layout.params == pytest.approx(expected(dp))


GPT = ps.ModelShape("gpt", 4, 1024, 16, 4096, 50257, 2048)


def test_activations_follow_korthikanti_et_al():
    s, b, h, a = 2048, 1, 1024, 16
    plain_par = ps.Parallel(1, 1, 1, recompute="none", flash_attention=False)
    assert ps.layer_activation_bytes(GPT, plain_par, b) == 34 * s * b * h + 5 * a * s * s * b
    for t in (2, 4, 8):
        tp = ps.Parallel(t, 1, 1, recompute="none", flash_attention=False)
        expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
        assert ps.layer_activation_bytes(GPT, tp, b) == expected
        sp = ps.Parallel(t, 1, 1, sequence_parallel=True, recompute="selective")
        assert ps.layer_activation_bytes(GPT, sp, b) == 34 * s * b * h / t
        full = ps.Parallel(t, 1, 1, sequence_parallel=True, recompute="full")
        assert ps.layer_activation_bytes(GPT, full, b) == 2 * s * b * h / t


def test_the_first_stage_holds_pp_microbatches_of_its_layers():
    par = ps.Parallel(2, 4, 1, micro_batch=1, global_batch=64, sequence_parallel=True)
    layer = ps.layer_activation_bytes(GPT, par, 1)
    assert ps.stage_activation_bytes(GPT, par, 0) == 1 * 4 * layer
    middle = ps.stage_activation_bytes(GPT, par, 2)
    assert middle == 1 * 2 * layer
    few = ps.Parallel(2, 4, 1, micro_batch=1, global_batch=2, sequence_parallel=True)
    assert ps.stage_activation_bytes(GPT, few, 0) == 1 * 2 * layer  # only 2 microbatches


@pytest.mark.parametrize(
    "key, published",
    [
        ("gpt-1.3b", 1.3e9),
        ("gpt-6.7b", 6.7e9),
        ("gpt-13b", 13.0e9),
        ("llama-30b", 32.5e9),
        ("llama-65b", 65.2e9),
        ("mixtral-8x7b", 46.7e9),
    ],
)
def test_model_shapes_have_their_published_sizes(key, published):
    assert ps.total_parameters(ps.MODELS[key]) == pytest.approx(published, rel=0.02)


def test_flops_per_token_is_six_per_weight_plus_attention():
    shape = ps.ModelShape("f", 2, 64, 4, 256, 128, 32, tied_embeddings=True)
    weights = 2 * (4 * 64 * 64 + 2 * 64 * 256) + 128 * 64
    assert ps.flops_per_token(shape) == 6 * weights + 12 * 2 * 32 * 64
    par = ps.Parallel(1, 1, 8, global_batch=16)
    hw = ps.HARDWARE["perlmutter-a100-40"]
    assert ps.iteration_seconds(shape, par, hw, 0.25) == pytest.approx(
        2 * ps.iteration_seconds(shape, par, hw, 0.5)
    )


def test_the_mirror_hides_unless_the_link_is_too_slow():
    shape, par = ps.MODELS["llama-65b"], ps.paper_layouts(512)["llama-65b"]
    hw = ps.HARDWARE["perlmutter-a100-40"]
    fast = ps.mirror_time(shape, par, hw, 0.45)
    layout = ps.rank_layout(shape, par, 0)
    assert fast.link == pytest.approx(layout.snapshot_bytes / 25e9)
    assert fast.hides and fast.exposed == 0
    slow = ps.mirror_time(shape, par, ps.Hardware("slow", 4, 40, 256, 312, 0.05, 25, ""), 0.45)
    assert not slow.hides and slow.exposed == pytest.approx(
        slow.link + slow.training_link - slow.iteration
    )


def test_the_mirror_share_does_not_grow_with_the_model():
    """Dense models: bytes per GPU and FLOPs per GPU both scale with
    parameters per GPU. An MoE model's bytes follow all its parameters and
    its FLOPs the active ones: its share is larger (Mixtral: 3.6x, about
    46.7 B total / 12.9 B active)."""
    hw = ps.HARDWARE["perlmutter-a100-40"]
    layouts = ps.paper_layouts(512)
    share = {k: ps.plan(ps.MODELS[k], par, hw, 0.45).time for k, par in layouts.items()}
    values = {k: t.link / t.iteration for k, t in share.items()}
    dense = [v for k, v in values.items() if ps.MODELS[k].num_experts is None]
    assert max(dense) / min(dense) < 1.2
    assert 3 < values["mixtral-8x7b"] / max(dense) < 4


def test_65b_on_512_a100s_fits_with_the_mirror_anywhere():
    p = ps.plan(
        ps.MODELS["llama-65b"],
        ps.paper_layouts(512)["llama-65b"],
        ps.HARDWARE["perlmutter-a100-40"],
        0.45,
    )
    assert p.fits and p.host_fits
    assert p.memory.mirror_bytes == 4 * p.layout.snapshot_bytes
    # The shard: about 65.3 B / (TP 4 x PP 8) / DP 16 parameters on the first stage.
    assert p.layout.shard_numel == pytest.approx(65.3e9 / 512, rel=0.03)
    device = ps.plan(p.model, p.parallel, p.hardware, 0.45, mirror_in_device=True)
    assert device.memory.total == p.memory.total + p.memory.mirror_bytes and device.fits


def test_paper_layouts_are_the_first_to_leave_a_third_of_the_memory_free():
    """TP grows inside the node first, then PP; each model's layout is the
    first in that order whose worst stage stays under two thirds of 40 GB."""
    hw = ps.HARDWARE["perlmutter-a100-40"]
    order = [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (4, 8), (4, 16)]
    for key, par in ps.paper_layouts(512).items():

        def used(tp, pp):
            trial = replace(par, tp=tp, pp=pp, dp=512 // (tp * pp), sequence_parallel=tp > 1)
            return ps.worst_stage_memory(ps.MODELS[key], trial).total

        first = next(tp_pp for tp_pp in order if used(*tp_pp) <= 2 / 3 * hw.gpu_memory_gib * ps.GiB)
        assert first == (par.tp, par.pp), key


def test_mixtral_on_512_a100s_mirrors_dense_and_expert_shards():
    """Mixtral 8x7B (TP4 PP1 DP128, EP8: expert-DP 16): the shard holds the
    dense tensors' 1/DP and the experts' 1/expert-DP; it fits with its
    mirror and the mirror hides in the iteration."""
    shape, par = ps.MODELS["mixtral-8x7b"], ps.paper_layouts(512)["mixtral-8x7b"]
    p = ps.plan(shape, par, ps.HARDWARE["perlmutter-a100-40"], 0.45)
    assert par.edp == 16 and p.fits and p.host_fits and p.time.hides
    tensors = ps.stage_parameters(shape, par.tp, par.pp, 0, par.etp, par.ep)
    experts = sum(t.numel for t in tensors if t.expert)
    dense = sum(t.numel for t in tensors if not t.expert)
    assert experts == 32 * 3 * 4096 * 14336 // 4  # one expert per EP rank, split by TP 4
    assert p.layout.shard_numel == pytest.approx(dense / 128 + experts / 16, rel=0.01)
    # Control: sharded over DP like the dense tensors, the shard would be 8x smaller.
    assert p.layout.shard_numel > 4 * (dense + experts) / 128
