"""The megatron-core configuration and layer spec a GPU run builds
(megatron/training/model_setup.py, pretrain_gpt.layer_spec), built here on
a CPU: a model megatron-core refuses on a GPU (a GELU model without bias
once was, its bias-activation fusion left on) is caught without one. The
flags are parsed as on a GPU node without Transformer Engine or Apex, and
as on one where Transformer Engine is importable (parsing is all that can
tell here: the configuration is then built without its kernels). Also the
recompute settings and the fused kernels a GPU run asks megatron-core for,
and the control: without the GPU-only features' flags, megatron-core's
defaults."""

import dataclasses
from unittest import mock

import pytest
import torch.nn.functional as F

from megatron.training import cpu_compat
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.flags import host
from tests.unit_tests.training.flags.test_gpu import on_a_gpu_node
from tests.unit_tests.training.flags.test_training import FULL_BLOCK, RECOMPUTE_BASE, SELECTIVE

cpu_compat.import_megatron_core_without_cuda()  # import-time only

from megatron.core.activations import squared_relu  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.identity_op import IdentityOp  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.training.cuda_graphs import cuda_graph_hooks  # noqa: E402
from megatron.training.model_setup import transformer_config  # noqa: E402
from megatron.training.sdpa import TorchSdpaAttention  # noqa: E402

BASE = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--bf16"),
]
# Model shapes of Megatron-LM's CI and release configs (and the models its
# flags build: Nemotron's squared ReLU, Qwen's QKV bias, OLMo's QK norm).
MODELS = {
    "gpt": [],
    "gelu-no-bias": ["--disable-bias-linear"],
    "swiglu-no-bias": ["--swiglu", "--disable-bias-linear"],
    "squared-relu-no-bias": ["--squared-relu", "--disable-bias-linear"],
    "qwen-like": ["--swiglu", "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm"],
    "llama-like": [
        *("--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm"),
        *("--position-embedding-type", "rope", "--group-query-attention"),
        *("--num-query-groups", "2", "--untie-embeddings-and-output-weights"),
    ],
    "qk-scaling": ["--apply-query-key-layer-scaling", "--attention-softmax-in-fp32"],
    "rope-interleaved-test-mode": [
        *("--position-embedding-type", "rope", "--rotary-interleaved", "--qk-layernorm"),
        *("--test-mode", "--no-persist-layer-norm"),
    ],
    "moe-gelu-no-bias": [
        *("--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"),
        *("--moe-router-dtype", "fp32"),
    ],
}


def gpu_config(flags, transformer_engine: bool):
    importable = {"transformer_engine"} if transformer_engine else set()
    with (
        mock.patch.object(host, "cuda_available", lambda: True),
        mock.patch.object(host, "gpu_count", lambda: 1),
        mock.patch.object(host, "importable", lambda module: module in importable),
    ):
        return parse_args(BASE + flags, world_size=1)


@pytest.mark.parametrize("transformer_engine", [False, True], ids=["no-te", "te"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_gpu_run_builds_its_megatron_core_configuration(name, transformer_engine):
    config = gpu_config(MODELS[name], transformer_engine)
    tf = transformer_config(config, on_cpu=False)
    m = config.model
    # Fused where megatron-core can fuse (GeLU only with a bias), as Megatron-LM.
    assert tf.bias_activation_fusion == (m.swiglu or not (m.disable_bias_linear or m.squared_relu))
    assert tf.add_qkv_bias == (m.add_qkv_bias or not m.disable_bias_linear)
    assert tf.qk_layernorm == m.qk_layernorm
    assert (tf.rotary_interleaved, tf.test_mode) == (m.rotary_interleaved, m.test_mode)
    assert not (m.no_persist_layer_norm and tf.persist_layer_norm)
    assert tf.activation_func is (
        F.silu if m.swiglu else squared_relu if m.squared_relu else F.gelu
    )
    if config.moe.num_experts is None:
        spec = pretrain_gpt.layer_spec(config, tf, on_cpu=False)
        # No Transformer Engine on this machine: local layers, torch's SDPA.
        attention = spec.submodules.self_attention.submodules
        assert attention.core_attention is TorchSdpaAttention
        assert (attention.q_layernorm is not IdentityOp) == m.qk_layernorm


def test_what_megatron_core_refuses_is_caught_here():
    """Control: the configuration this build made before, a GELU model
    without bias and its bias-activation fusion on, raises on a CPU too."""
    tf = transformer_config(gpu_config(["--disable-bias-linear"], False), on_cpu=False)
    fields = {f.name: getattr(tf, f.name) for f in dataclasses.fields(tf) if f.init}
    with pytest.raises(ValueError, match="add_bias_linear must also be True"):
        TransformerConfig(**dict(fields, bias_activation_fusion=True))


def test_fp8_keeps_the_first_and_last_layers_in_bf16_when_asked():
    """--first-last-layers-bf16 and its counts reach megatron-core, whose
    checks run before any process group (it refuses a delayed recipe)."""
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--first-last-layers-bf16"]
    config = gpu_config(fp8 + ["--num-layers-at-end-in-bf16", "2"], transformer_engine=True)
    tf = transformer_config(config, on_cpu=False)
    assert (tf.first_last_layers_bf16, tf.num_layers_at_start_in_bf16) == (True, 1)
    assert tf.num_layers_at_end_in_bf16 == 2
    # megatron-core refuses them with a delayed recipe: said at parse time.
    delayed = fp8 + ["--fp8-recipe", "delayed"]
    with pytest.raises(ConfigError, match="Delayed scaling does not support"):
        gpu_config(delayed, transformer_engine=True)


def test_the_settings_reach_megatron_cores_transformer_config():
    from megatron.training.model_setup import transformer_config

    config = parse_args(RECOMPUTE_BASE + FULL_BLOCK, world_size=1)
    tf = transformer_config(config, on_cpu=True)
    assert (tf.recompute_granularity, tf.recompute_method, tf.recompute_num_layers) == (
        "full",
        "block",
        2,
    )
    modules = ["--recompute-modules", "core_attn", "layernorm"]
    tf = transformer_config(
        parse_args(RECOMPUTE_BASE + SELECTIVE + modules, world_size=1), on_cpu=True
    )
    assert tf.recompute_modules == ["core_attn", "layernorm"]


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
    tf = model_setup.transformer_config(parse_args(RECOMPUTE_BASE, world_size=1), on_cpu=False)
    assert tf.persist_layer_norm == ("apex" in present)
    assert tf.masked_softmax_fusion == ("scaled_masked_softmax_cuda" in present)
    assert tf.bias_dropout_fusion  # torch.compile's, on any GPU
    cpu = model_setup.transformer_config(parse_args(RECOMPUTE_BASE, world_size=1), on_cpu=True)
    assert not (cpu.persist_layer_norm or cpu.masked_softmax_fusion or cpu.bias_dropout_fusion)


def test_no_feature_no_megatron_core_fields_changed():
    """Control: without the gpu section's flags the configuration keeps
    megatron-core's defaults (no overlap, no graphs, no offloading)."""
    tf = transformer_config(on_a_gpu_node([]), on_cpu=False)
    assert not (tf.tp_comm_overlap or tf.overlap_moe_expert_parallel_comm)
    assert not tf.fine_grained_activation_offloading
    assert tf.cuda_graph_impl == "none" and cuda_graph_hooks(on_a_gpu_node([])) == []
