"""Activation recompute through pretrain_gpt.py: Megatron-LM's flags, passed
to megatron-core's own recompute (no reimplementation), refused up front where
they cannot run; recompute really runs (layers and attention cores run twice
per microbatch) and changes nothing: with dropout on, the curve equals the
run without recompute bit for bit, because megatron-core restores the RNG
streams before it recomputes. Hot swap with recompute: test_hot_swap.py."""

import json
import sys

import pytest

import forkserver
from dist_utils import MOCK_GPT, REPO, curve, read_metrics, run_pretrain, worker_env
from deadpool_ext.control.launch import free_port
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


# --- megatron-core really recomputes ------------------------------------------------

# One process: builds pretrain_gpt.py's model for the flags given in argv and
# counts, over one forward and backward, how often layer 0 and its attention
# core run.
PROBE = """
import json, os, sys
import torch
import torch.distributed as dist
from megatron.training import cpu_compat
from megatron.training.arguments import parse_args
from megatron.training.model_setup import transformer_config
import pretrain_gpt

cpu_compat.enable(force=True)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
from megatron.core import parallel_state, tensor_parallel
parallel_state.initialize_model_parallel()
tensor_parallel.model_parallel_cuda_manual_seed(1234)
config = parse_args(json.loads(sys.argv[2]), world_size=1)
config.extra["padded_vocab_size"] = 128
model = pretrain_gpt.model_provider(config, transformer_config(config, True), True, True)
layer = model.decoder.layers[0]
calls = {"layer": 0, "core_attention": 0}
def count(name):
    def hook(*_):
        calls[name] += 1
    return hook
layer.register_forward_hook(count("layer"))
layer.self_attention.core_attention.register_forward_hook(count("core_attention"))
tokens = torch.randint(0, 128, (2, 32))
positions = torch.arange(32).unsqueeze(0).expand(2, -1)
mask = torch.tril(torch.ones(1, 1, 32, 32)) < 0.5
model(tokens, positions, mask, labels=tokens).float().mean().backward()
print(json.dumps(calls))
"""


def forward_calls(extra) -> dict:
    command = [sys.executable, "-c", PROBE, str(free_port()), json.dumps(BASE + extra)]
    proc = forkserver.run(command, worker_env(), REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.integration
def test_megatron_core_recomputes_what_the_flags_say():
    assert forward_calls([]) == {"layer": 1, "core_attention": 1}
    assert forward_calls(FULL_UNIFORM) == {"layer": 2, "core_attention": 2}
    assert forward_calls(FULL_BLOCK) == {"layer": 2, "core_attention": 2}  # layer 0 of 2
    assert forward_calls(SELECTIVE) == {"layer": 1, "core_attention": 2}


# --- the same training, bit for bit --------------------------------------------------

RUN = BASE + ["--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0"]
RUN += ["--num-workers", "0", "--tensor-model-parallel-size", "2"]


def curve_of(tmp, *extra) -> list:
    tmp.mkdir(parents=True, exist_ok=True)
    run_pretrain(2, RUN + ["--metrics-file", str(tmp / "metrics.jsonl"), *extra])
    return curve(read_metrics(str(tmp / "metrics.jsonl")))


@pytest.mark.integration
def test_recompute_with_dropout_trains_the_same_curve_bit_for_bit(tmp_path):
    """Dropout 0.1 on attention and hidden states (the defaults): a recomputed
    forward that drew other masks would change every gradient."""
    plain = curve_of(tmp_path / "plain")
    assert curve_of(tmp_path / "full", *FULL_UNIFORM) == plain
    assert curve_of(tmp_path / "selective", *SELECTIVE) == plain
    distributed = curve_of(
        tmp_path / "distributed", *FULL_UNIFORM, "--distribute-saved-activations"
    )
    assert distributed == plain
    # Negative control: the curve does depend on the dropout masks.
    assert curve_of(tmp_path / "other-seed", "--seed", "4321") != plain


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
