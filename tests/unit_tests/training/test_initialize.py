"""A trainer's initialize (megatron/training/initialize.py), in-process: the
device and the process's switches are set up once per process
(initialize.setup_device): a deadpool rank sets them up before its first
process group or its warm-up (deadpool_ext/rank/main.py), and each trainer
it builds later finds them set when its initialize asks again. And
Transformer Engine's userbuffers set up as Megatron-LM sets them up (a
stand-in module: the real one needs a GPU)."""

import sys
import types

from megatron.training import initialize
from megatron.training.arguments import parse_args
from tests.unit_tests.training.flags.test_gpu import TP2_SP, on_a_gpu_node


def config():
    argv = [
        *("--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"),
        *("--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "4"),
        *("--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer"),
        *("--vocab-size", "100", "--cpu"),
    ]
    return parse_args(argv, world_size=1)


def test_the_device_is_set_up_once_per_process(monkeypatch):
    switches = []
    for module, name in (
        (initialize.cpu_compat, "define_missing_te_names"),
        (initialize.cpu_compat, "enable"),
        (initialize.optimizer_layout, "patch_reshardable_load"),
        (initialize.optimizer_layout, "patch_reshardable_save"),
    ):
        monkeypatch.setattr(module, name, lambda *a, name=name, **k: switches.append(name))
    monkeypatch.setattr(initialize, "_on_cpu", None)  # a process that set nothing up yet
    cfg = config()
    assert initialize.setup_device(cfg)  # the rank's main, before its first group
    one_setup = list(switches)
    assert "enable" in one_setup  # on the CPU
    assert initialize.setup_device(cfg)  # its trainer's initialize
    assert switches == one_setup
    # The control: a process that has set nothing up yet sets everything up.
    monkeypatch.setattr(initialize, "_on_cpu", None)
    initialize.setup_device(cfg)
    assert switches == one_setup * 2


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
