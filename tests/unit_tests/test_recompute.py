"""Activation recompute through pretrain_gpt.py, in-process: Megatron-LM's
flags, passed to megatron-core's own recompute (no reimplementation), refused
up front where they cannot run, and the fused kernels a GPU run asks
megatron-core for. That recompute really runs and changes nothing is in
tests/functional_tests/test_recompute.py; hot swap with recompute:
test_hot_swap.py."""

import pytest

from dist_utils import MOCK_GPT
from megatron.training.arguments import ConfigError, parse_args

BASE = MOCK_GPT + ["--num-layers", "4"]
FULL_UNIFORM = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
FULL_UNIFORM += ["--recompute-num-layers", "1"]
FULL_BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block"]
FULL_BLOCK += ["--recompute-num-layers", "2"]
SELECTIVE = ["--recompute-granularity", "selective"]


def _error(extra, world_size=1) -> str:
    with pytest.raises(ConfigError) as info:
        parse_args(BASE + extra, world_size=world_size)
    return str(info.value)


# --- flags: Megatron-LM's names, defaults and rules ---------------------------------


def test_recompute_activations_is_selective_recompute_as_megatron_lm():
    assert parse_args(BASE, world_size=1).training.recompute_granularity is None
    t = parse_args(BASE + ["--recompute-activations"], world_size=1).training
    assert t.recompute_granularity == "selective" and t.recompute_method is None


def test_the_settings_reach_megatron_cores_transformer_config():
    from megatron.training.model_setup import transformer_config

    config = parse_args(BASE + FULL_BLOCK, world_size=1)
    tf = transformer_config(config, on_cpu=True)
    assert (tf.recompute_granularity, tf.recompute_method, tf.recompute_num_layers) == (
        "full",
        "block",
        2,
    )
    modules = ["--recompute-modules", "core_attn", "layernorm"]
    tf = transformer_config(parse_args(BASE + SELECTIVE + modules, world_size=1), on_cpu=True)
    assert tf.recompute_modules == ["core_attn", "layernorm"]


@pytest.mark.parametrize(
    "extra, world, words",
    [
        (SELECTIVE + ["--recompute-method", "block"], 1, "goes with --recompute-granularity full"),
        (["--recompute-granularity", "full"], 1, "megatron-core refuses these settings"),
        (FULL_UNIFORM + ["--distribute-saved-activations"], 1, "needs --recompute-granularity"),
        (SELECTIVE + ["--recompute-modules", "everything"], 1, "megatron-core refuses"),
    ],
)
def test_settings_that_cannot_run_are_refused(extra, world, words):
    assert words in _error(extra, world)


def test_recompute_settings_without_a_granularity_are_ignored_with_a_warning(capsys):
    """As Megatron-LM (megatron-core reads them only with a granularity);
    one of its CI configs passes --recompute-num-layers alone."""
    config = parse_args(
        BASE + ["--recompute-method", "uniform", "--recompute-num-layers", "2"], world_size=1
    )
    printed = capsys.readouterr().out
    assert (
        "--recompute-method, --recompute-num-layers have no effect without --recompute-granularity"
        in printed
    )
    assert config.training.recompute_granularity is None


# --- the fused kernels a GPU run asks megatron-core for ------------------------------


@pytest.mark.parametrize("present", [(), ("apex", "scaled_masked_softmax_cuda")])
def test_a_gpu_run_fuses_only_what_has_a_kernel_there(monkeypatch, present):
    """Megatron-LM's defaults persist the layer norm and fuse scale-mask-softmax;
    without Apex or Transformer Engine megatron-core has neither kernel and
    fails (both seen on an H200): there the run takes torch's."""
    import importlib.util

    from megatron.training import model_setup

    optional = {"apex", "scaled_masked_softmax_cuda", "transformer_engine"}
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name in optional:
            return object() if name in present else None
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    tf = model_setup.transformer_config(parse_args(BASE, world_size=1), on_cpu=False)
    assert tf.persist_layer_norm == ("apex" in present)
    assert tf.masked_softmax_fusion == ("scaled_masked_softmax_cuda" in present)
    assert tf.bias_dropout_fusion  # torch.compile's, on any GPU
    cpu = model_setup.transformer_config(parse_args(BASE, world_size=1), on_cpu=True)
    assert not (cpu.persist_layer_norm or cpu.masked_softmax_fusion or cpu.bias_dropout_fusion)
