"""The mixture of experts' flags (megatron/training/flags/moe.py), parsed
in-process: refused up front where megatron-core's MoE layers cannot run,
Megatron-LM's defaults and layer patterns. The runs on ranks are in
tests/functional_tests/test_moe.py."""

import pytest

from dist_utils import MOCK_GPT
from megatron.training.arguments import ConfigError, parse_args
from tests.unit_tests.training.command_line import _config_error, _names_all, argv

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


def test_moe_with_the_tp_pp_dp_order_is_refused_where_megatron_core_would_stop():
    """EP 2 over PP 2 on 8 ranks with --use-tp-pp-dp-mapping: megatron-core's
    assertion at group creation, said here before any group exists."""
    moe = argv(
        *("--num-experts", "4", "--expert-model-parallel-size", "2"),
        *("--pipeline-model-parallel-size", "2", "--disable-bias-linear"),
    )
    message = _config_error(moe + ["--use-tp-pp-dp-mapping"], world_size=8)
    _names_all(message, "--use-tp-pp-dp-mapping", "--expert-model-parallel-size")
    parse_args(moe, world_size=8)  # Megatron's default order takes it
