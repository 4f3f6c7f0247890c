"""Mixture of experts through pretrain_gpt.py, in-process: megatron-core's
MoE layers with Megatron-LM's flags, refused up front where they cannot run,
Megatron-LM's defaults and layer patterns, deadpool's buddies for any
expert-parallel size, and the throughput arithmetic. The runs on ranks are in
tests/functional_tests/test_moe.py."""

import pytest

from dist_utils import MOCK_GPT
from megatron.training import layout_invariant_init, log
from megatron.training.arguments import ConfigError, parse_args

BASE = MOCK_GPT
MOE = ["--num-experts", "4", "--disable-bias-linear"]


def _error(extra, world_size=1, base=BASE + MOE) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(base + extra, world_size=world_size)
    return str(info.value)


# --- refused before any process group, with what to change ------------------------


def test_experts_split_without_experts_are_refused_by_name():
    """As Megatron-LM: expert parallelism without experts is refused; the
    other MoE flags have no effect without them (the parse warns)."""
    message = _error(["--moe-router-topk", "1", "--expert-model-parallel-size", "2"], 2, BASE)
    assert "--expert-model-parallel-size" in message and "--num-experts" in message


@pytest.mark.parametrize(
    "extra, world, words",
    [
        (["--expert-model-parallel-size", "3"], 3, "not divisible by --expert-model-parallel"),
        (["--moe-router-topk", "5"], 1, "--moe-router-topk 5 must be between 1 and"),
        (["--expert-model-parallel-size", "4"], 2, "world size 2 is not divisible by expert"),
        (["--moe-token-dispatcher-type", "flex"], 1, "DeepEP"),
        (["--moe-grouped-gemm"], 1, "--moe-grouped-gemm runs"),
        (["--moe-pad-expert-input-to-capacity"], 1, "goes with --moe-expert-capacity-factor"),
        (
            ["--moe-router-load-balancing-type", "aux_loss", "z_loss"],
            1,
            "invalid choice",
        ),
        (
            ["--moe-router-load-balancing-type", "sinkhorn", "--moe-aux-loss-coeff", "0.01"],
            1,
            "drop --moe-aux-loss-coeff",
        ),
        (
            ["--moe-expert-capacity-factor", "1", "--moe-router-load-balancing-type", "sinkhorn"],
            1,
            "megatron-core refuses these settings: moe_expert_capacity_factor",
        ),
        (["--moe-layer-freq", "[0,1,1]"], 1, "--moe-layer-freq gives 3 layers and --num-layers"),
        (["--moe-layer-freq", "3"], 1, "--moe-layer-freq 3 must be between 1 and --num-layers 2"),
        (["--moe-layer-freq", "[0]*2+os"], 1, "not a layer frequency or pattern"),
        (["--moe-layer-freq", "[2,1]"], 1, "a layer pattern lists 0s (dense) and 1s (MoE)"),
        (["--moe-permute-fusion"], 1, "--moe-permute-fusion runs Transformer Engine's fused"),
        (["--moe-router-fusion"], 1, "--moe-router-fusion runs Transformer Engine's fused"),
        (["--moe-router-enable-expert-bias"], 1, "set --moe-router-score-function sigmoid"),
        (
            ["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"],
            1,
            "moe_router_group_topk (3) should be smaller than moe_router_num_groups (2)",
        ),
    ],
)
def test_moe_settings_that_cannot_run_are_refused(extra, world, words):
    assert words in _error(extra, world)


def test_biases_are_refused_where_megatron_core_cannot_run_them():
    with_bias = BASE + ["--num-experts", "4"]
    assert "add --disable-bias-linear" in _error([], 1, with_bias)
    assert "add --disable-bias-linear" in _error(
        ["--moe-shared-expert-intermediate-size", "32", "--expert-model-parallel-size", "2"],
        2,
        with_bias,
    )
    # Expert parallelism runs biased experts (megatron-core's explicit expert comm).
    parse_args(with_bias + ["--expert-model-parallel-size", "2"], world_size=2)


def test_tensor_parallel_moe_needs_sequence_parallel():
    message = _error(["--tensor-model-parallel-size", "2"], 2)
    assert "need --sequence-parallel" in message


def test_multi_token_prediction_is_refused_where_megatron_core_cannot_run_it():
    mtp = ["--mtp-num-layers", "1"]
    assert "needs --position-embedding-type rope" in _error(mtp, 1, BASE)
    rope = ["--position-embedding-type", "rope"]
    pipeline = ["--pipeline-model-parallel-size", "2"]
    assert "needs --untie-embeddings-and-output-weights" in _error(mtp + rope + pipeline, 2, BASE)
    untied = ["--untie-embeddings-and-output-weights"]
    parse_args(BASE + mtp + rope + pipeline + untied, world_size=2)
    parse_args(BASE + mtp + rope, world_size=1)  # one stage: tied is fine


def test_a_layer_pattern_is_read_as_megatron_lm_reads_it():
    config = parse_args(BASE + MOE + ["--moe-layer-freq", "([0]*1+[1]*1)"], world_size=1)
    assert config.moe.moe_layer_freq == [0, 1]
    every_other = parse_args(BASE + MOE + ["--moe-layer-freq", "2"], world_size=1)
    assert every_other.moe.moe_layer_freq == 2


def test_megatron_lms_defaults_and_single_values():
    config = parse_args(
        BASE + MOE + ["--moe-router-load-balancing-type", "seq_aux_loss"], world_size=1
    )
    moe = config.moe
    assert moe.moe_ffn_hidden_size == config.model.ffn_hidden_size == 256
    assert moe.moe_router_load_balancing_type == "seq_aux_loss"  # not a list of one
    assert moe.moe_aux_loss_coeff == 0.0
    assert config.parallel.expert_tensor_parallel_size == 1
    assert parse_args(BASE + ["--num-experts", "0"], world_size=1).moe.num_experts is None


def test_deadpool_takes_moe_whatever_its_expert_parallel_size(monkeypatch):
    """4 ranks on 2-rank nodes: EP 2 leaves expert-DP 2 (buddies hold the
    same experts), EP 4 leaves 1 (buddies hold others' snapshots)."""
    from deadpool_ext.config import parse_args as deadpool_parse, plan_buddies

    monkeypatch.setenv("WORLD_SIZE", "4")
    flags = BASE + MOE + ["--use-distributed-optimizer", "--deadpool"]
    flags += ["--deadpool-ranks-per-node", "2"]
    for ep, apart in ((2, False), (4, True)):
        config = deadpool_parse(flags + ["--expert-model-parallel-size", str(ep)], environ={})
        assert plan_buddies(config, environ={}).experts_apart is apart


# --- arithmetic -------------------------------------------------------------------


def test_throughput_counts_the_routed_and_shared_experts_as_megatron_lm():
    config = parse_args(
        BASE
        + MOE
        + ["--moe-router-topk", "2", "--moe-ffn-hidden-size", "96"]
        + ["--moe-shared-expert-intermediate-size", "32"],
        world_size=1,
    )
    config.run.padded_vocab_size = 128
    h, s, layers, gbs = 64, 32, 2, 8
    # Megatron-LM's transformer_flops, term by term: 3 (fwd+bwd) x 2 (FMA) x h x
    # (routed experts: moe_ffn x topk x 2 GEMMs, shared: its width x 2) ...
    mlp = 3 * 2 * h * (96 * 2 * 2 + 32 * 2)
    attention = 3 * 2 * (h * (64 + 64 + 64) + 64 * s / 2 * 2 + 64 * h)
    logits = 3 * 2 * h * 128
    expected = gbs * s * (layers * (mlp + attention) + logits)
    assert log.flops_per_iteration(config, gbs) == expected


def test_throughput_counts_dense_layers_and_multi_token_prediction_as_megatron_lm():
    """Megatron-LM's transformer_flops with --moe-layer-freq and MTP, term by
    term: a dense first layer, an MoE second, one MTP layer like the last
    (MoE), the MTP layer's two norms (3h) and projection (2h x h), and the
    logits once more."""
    config = parse_args(
        BASE
        + MOE
        + ["--moe-router-topk", "2", "--moe-ffn-hidden-size", "96"]
        + ["--moe-layer-freq", "[0,1]", "--mtp-num-layers", "1"]
        + ["--position-embedding-type", "rope"],
        world_size=1,
    )
    config.run.padded_vocab_size = 128
    h, s, gbs, ffn = 64, 32, 8, 256
    dense, routed = 3 * 2 * h * ffn * 2, 3 * 2 * h * 96 * 2 * 2
    attention = 3 * 2 * (h * (64 + 64 + 64) + 64 * s / 2 * 2 + 64 * h)
    mtp = 3 * 2 * 1 * (3 * h + 2 * h * h)
    logits = 3 * 2 * h * 128 * 2
    expected = gbs * s * (dense + 2 * routed + 3 * attention + mtp + logits)
    assert log.flops_per_iteration(config, gbs) == expected


def test_an_expert_parallel_ranks_local_experts_have_their_global_names():
    local = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    assert layout_invariant_init.global_name(local, 2, False, expert_offset=2) == (
        "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"
    )
