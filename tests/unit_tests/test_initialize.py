"""The device and the process's switches are set up once per process
(initialize.setup_device): a deadpool rank sets them up before its first
process group or its warm-up (deadpool_ext/rank/main.py), and each trainer
it builds later finds them set when its initialize asks again."""

from megatron.training import initialize
from megatron.training.arguments import parse_args


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
