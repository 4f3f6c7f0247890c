"""Megatron-LM's GPU-only features (the gpu section: Transformer Engine's
tensor-parallel overlap, the MoE communication overlap, fine-grained
activation offloading, Transformer Engine's CUDA graphs): their rules at
parse time, the megatron-core configuration a GPU run builds with them (built
here, on a CPU), and the wiring that runs them (the userbuffers' setup, the
schedule plan of the combined 1F1B schedule, the graphs' capture), each with
stand-ins for what only a GPU has."""

import sys
import types
from functools import partial
from unittest import mock

import pytest

from megatron.training import cpu_compat
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.flags import host

cpu_compat.import_megatron_core_without_cuda()  # import-time only

from megatron.core.transformer.enums import CudaGraphScope  # noqa: E402

import pretrain_gpt  # noqa: E402
from megatron.training import initialize  # noqa: E402
from megatron.training.cuda_graphs import CudaGraphHook, cuda_graph_hooks  # noqa: E402
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


# --- parse time -----------------------------------------------------------------------


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


def test_no_feature_no_megatron_core_fields_changed():
    """Control: without the gpu section's flags the configuration keeps
    megatron-core's defaults (no overlap, no graphs, no offloading)."""
    tf = transformer_config(on_a_gpu_node([]), on_cpu=False)
    assert not (tf.tp_comm_overlap or tf.overlap_moe_expert_parallel_comm)
    assert not tf.fine_grained_activation_offloading
    assert tf.cuda_graph_impl == "none" and cuda_graph_hooks(on_a_gpu_node([])) == []


# --- the wiring that runs them ------------------------------------------------------


def test_the_userbuffers_are_set_up_as_megatron_lm_sets_them_up(tmp_path, monkeypatch):
    """Transformer Engine's initialize_ub gets one microbatch's
    sequence-parallel activations and the YAML settings (a stand-in module:
    the real one needs a GPU)."""
    calls = []
    modes = types.SimpleNamespace(FP8="fp8", NONE="none")
    base = types.SimpleNamespace(
        UserBufferQuantizationMode=modes, initialize_ub=lambda **kw: calls.append(kw)
    )
    settings = tmp_path / "ub.yaml"
    settings.write_text("qkv_fprop:\n  method: ring_exchange\n")
    flags = TP2_SP + ["--tp-comm-overlap", "--tp-comm-overlap-cfg", str(settings)]
    config = on_a_gpu_node(flags, 2)
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.module = types.SimpleNamespace(base=base)
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    initialize.init_tp_communicators(config)
    assert calls == [
        dict(
            shape=[2 * 32, 64],  # micro batch x sequence, hidden
            tp_size=2,
            ub_cfgs={"qkv_fprop": {"method": "ring_exchange"}},
            bootstrap_backend="nccl",
            quantization_modes=["none"],
        )
    ]


class _Model:
    def __init__(self):
        self.called = []

    def __call__(self, *args, **kwargs):
        self.called.append("forward")
        return "output"

    def build_schedule_plan(self, *args, **kwargs):
        self.called.append("plan")
        return "plan"


def test_the_forward_step_gives_the_combined_schedule_its_plan(monkeypatch):
    """megatron-core's combined 1F1B schedule asks the forward step for the
    model's schedule plan; the same inputs, the same loss function."""
    batch = ("tokens", "labels", "mask", None, "positions")
    monkeypatch.setattr(pretrain_gpt, "get_batch", lambda iterator: batch)
    model = _Model()
    output, loss = pretrain_gpt.forward_step(None, model, return_schedule_plan=True)
    assert output == "plan" and model.called == ["plan"]
    assert isinstance(loss, partial) and loss.args == ("mask",)
    # Control: without it, the forward itself.
    assert pretrain_gpt.forward_step(None, model)[0] == "output"


class _Chunk:
    def __init__(self, log):
        self.log = log

    def disable_forward_pre_hook(self, param_sync=True):
        self.log.append(("disable", param_sync))

    def enable_forward_pre_hook(self):
        self.log.append("enable")


class _Helper:
    def __init__(self, log):
        self.log, self.created = log, False

    def graphs_created(self):
        return self.created

    def create_cudagraphs(self):
        self.log.append("capture")
        self.created = True

    def cuda_graph_set_manual_hooks(self):
        self.log.append("manual hooks")

    def delete_cuda_graphs(self):
        self.log.append("delete")


def _trainer(iteration, warmup, overlap, log):
    gpu = types.SimpleNamespace(cuda_graph_warmup_steps=warmup)
    parallel = types.SimpleNamespace(overlap_param_gather=overlap)
    return types.SimpleNamespace(
        progress=types.SimpleNamespace(iteration=iteration),
        config=types.SimpleNamespace(gpu=gpu, parallel=parallel),
        state=types.SimpleNamespace(model=[_Chunk(log), _Chunk(log)]),
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_the_graphs_are_captured_after_the_warmup_once_and_deleted_at_the_end(overlap):
    log = []
    hook = CudaGraphHook()
    hook.helper, hook.start_iteration = _Helper(log), 5  # resumed at iteration 5
    for iteration in range(5, 10):
        hook.before_step(_trainer(iteration, warmup=2, overlap=overlap, log=log))
        log.append(iteration)
    hook.on_train_end(_trainer(10, 2, overlap, log))
    around = [("disable", False), ("disable", False), "capture", "enable", "enable"]
    captured = (around + ["manual hooks"]) if overlap else ["capture"]
    assert log == [5, 6, *captured, 7, 8, 9, "delete"]
