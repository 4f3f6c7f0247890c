"""Megatron-LM's GPU-only features (megatron/training/flags/gpu.py: Transformer
Engine's tensor-parallel overlap, the MoE communication overlap,
fine-grained activation offloading, Transformer Engine's CUDA graphs):
their rules at parse time, and the megatron-core configuration a GPU run
builds with them (built here, on a CPU, with stand-ins for what only a GPU
has)."""

from unittest import mock

import pytest

from megatron.training import cpu_compat
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.flags import host

cpu_compat.import_megatron_core_without_cuda()  # import-time only

from megatron.core.transformer.enums import CudaGraphScope  # noqa: E402

from megatron.training.model_setup import transformer_config  # noqa: E402

BASE = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--bf16"),
]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
MOE_EP2 = [
    *("--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear"),
    *("--moe-token-dispatcher-type", "alltoall"),
]
OFFLOAD = ["--fine-grained-activation-offloading", "--offload-modules", "core_attn", "attn_proj"]


def on_a_gpu_node(flags, world_size=1, importable=lambda module: True):
    """Parsed as on a GPU node where Transformer Engine (and every package) is
    importable, as Megatron-LM's CI node."""
    with (
        mock.patch.object(host, "cuda_available", lambda: True),
        mock.patch.object(host, "gpu_count", lambda: 8),
        mock.patch.object(host, "importable", importable),
        mock.patch.dict("os.environ", {"LOCAL_WORLD_SIZE": str(world_size)}),
    ):
        return parse_args(BASE + flags, world_size=world_size)


def refusal(flags, world_size=1, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        on_a_gpu_node(flags, world_size, **kwargs)
    return str(caught.value)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tp-comm-overlap"], "--tp-comm-overlap"),
        (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm"),
        (OFFLOAD, "--fine-grained-activation-offloading"),
        (["--cuda-graph-impl", "transformer_engine"], "--cuda-graph-impl transformer_engine"),
        (["--te-rng-tracker"], "--te-rng-tracker"),
    ],
)
def test_each_feature_is_refused_on_a_cpu_by_name(flags, named):
    with pytest.raises(ConfigError) as caught:
        parse_args(BASE + flags, world_size=1)
    assert named in str(caught.value) and "GPU only" in str(caught.value)


def test_transformer_engines_features_need_it_on_a_gpu_too():
    no_te = lambda module: module != "transformer_engine"  # noqa: E731
    message = refusal(["--cuda-graph-impl", "transformer_engine"], importable=no_te)
    assert "--cuda-graph-impl transformer_engine: needs Transformer Engine" in message
    # Control: with it, taken; megatron-core's own schedule needs no TE.
    on_a_gpu_node(["--cuda-graph-impl", "transformer_engine"])
    overlap = MOE_EP2 + ["--overlap-moe-expert-parallel-comm"]
    assert on_a_gpu_node(overlap, 2, importable=no_te).gpu.overlap_moe_expert_parallel_comm
    message = refusal(overlap + ["--delay-wgrad-compute"], 2, importable=no_te)
    assert "--delay-wgrad-compute: needs Transformer Engine" in message


def test_tensor_parallel_overlap_follows_megatron_lms_rules(tmp_path, capsys):
    message = refusal(["--tensor-model-parallel-size", "2", "--tp-comm-overlap"], 2)
    assert "add --sequence-parallel" in message
    missing = tmp_path / "none.yaml"
    message = refusal(TP2_SP + ["--tp-comm-overlap", "--tp-comm-overlap-cfg", str(missing)], 2)
    assert f"--tp-comm-overlap-cfg {missing}: no such file" in message
    settings = tmp_path / "ub.yaml"
    settings.write_text("qkv_fprop:\n  method: ring_exchange\n")
    flags = TP2_SP + ["--tp-comm-overlap", "--tp-comm-overlap-cfg", str(settings)]
    flags += ["--disable-tp-comm-overlap-ag", "--tp-comm-bootstrap-backend", "gloo"]
    tf = transformer_config(on_a_gpu_node(flags, 2), on_cpu=False)
    assert (tf.tp_comm_overlap, tf.tp_comm_overlap_ag, tf.tp_comm_overlap_rs) == (True, False, True)
    assert tf.tp_comm_bootstrap_backend == "gloo"
    # Its settings without it have no effect, as in Megatron-LM: said.
    capsys.readouterr()
    on_a_gpu_node(TP2_SP + ["--disable-tp-comm-overlap-ag", "--tp-comm-overlap-cfg", "x"], 2)
    out = capsys.readouterr().out
    assert "--tp-comm-overlap-cfg, --disable-tp-comm-overlap-ag have no effect without " in out


def test_the_moe_overlap_reaches_megatron_core_which_checks_it():
    flags = MOE_EP2 + ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    tf = transformer_config(on_a_gpu_node(flags, 2), on_cpu=False)
    assert tf.overlap_moe_expert_parallel_comm and tf.delay_wgrad_compute
    for alone in ("--delay-wgrad-compute", "--ep-overlap-early-attn-memory-release"):
        message = refusal(MOE_EP2 + [alone], 2)
        assert f"{alone} goes with --overlap-moe-expert-parallel-comm" in message
    # megatron-core's own rule, said at parse time: the overlap needs experts
    # spread over ranks.
    one_rank = ["--num-experts", "4", "--disable-bias-linear", "--moe-token-dispatcher-type"]
    message = refusal(one_rank + ["alltoall", "--overlap-moe-expert-parallel-comm"])
    assert "megatron-core refuses" in message and "expert model parallelism" in message


def test_activation_offloading_follows_megatron_lms_rules(monkeypatch):
    tf = transformer_config(on_a_gpu_node(OFFLOAD), on_cpu=False)
    assert tf.fine_grained_activation_offloading
    assert tf.offload_modules == ["core_attn", "attn_proj"]
    assert "needs --offload-modules" in refusal(["--fine-grained-activation-offloading"])
    no_nvml = lambda module: module != "pynvml"  # noqa: E731
    assert "nvidia-ml-py" in refusal(OFFLOAD, importable=no_nvml)
    # Transformer Engine 2.10 and later offload the weights too unless told.
    monkeypatch.setattr(host, "package_version", lambda name: (2, 10))
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    assert "NVTE_CPU_OFFLOAD_V1=1" in refusal(OFFLOAD)
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    on_a_gpu_node(OFFLOAD)


def test_cuda_graphs_follow_megatron_lms_rules(monkeypatch, capsys):
    graphs = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "attn", "mlp"]
    config = on_a_gpu_node(graphs + ["--cuda-graph-warmup-steps", "0"])
    assert "turning --te-rng-tracker on" in capsys.readouterr().out
    tf = transformer_config(config, on_cpu=False)
    assert tf.cuda_graph_impl == "transformer_engine" and config.gpu.te_rng_tracker
    assert tf.cuda_graph_scope == [CudaGraphScope.attn, CudaGraphScope.mlp]
    assert tf.cuda_graph_warmup_steps == 0
    assert "local (megatron-core's own graphs) is not here" in refusal(
        ["--cuda-graph-impl", "local"]
    )
    assert "--cuda-graph-scope full_iteration: not a scope" in refusal(
        ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope", "full_iteration"]
    )
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "NCCL_GRAPH_REGISTER=0" in refusal(graphs)
    monkeypatch.setenv("NCCL_GRAPH_REGISTER", "0")
    on_a_gpu_node(graphs)
    # The deprecated spelling: Transformer Engine's graphs, with a warning.
    capsys.readouterr()
    config = on_a_gpu_node(["--external-cuda-graph"])
    assert config.gpu.cuda_graph_impl == "transformer_engine"
    assert "--external-cuda-graph is deprecated" in capsys.readouterr().out


def test_settings_without_their_feature_are_said_to_have_no_effect(capsys):
    parse_args(
        BASE + ["--cuda-graph-scope", "attn", "--offload-modules", "core_attn"], world_size=1
    )
    out = capsys.readouterr().out
    assert "--cuda-graph-scope has no effect without --cuda-graph-impl" in out
    assert "--offload-modules has no effect without --fine-grained-activation-offloading" in out
