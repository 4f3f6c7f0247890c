"""What the sbatch scripts of examples/slurm/ rely on, in-process: the
launcher's SIGTERM handling (the ranks save on SIGTERM when they handle it,
else the job ends). The scripts' dry runs, on_node.sh, bad input and
shellcheck are in tests/functional_tests/test_slurm_scripts.py."""

import signal
from types import SimpleNamespace

import pytest

from deadpool_ext.control import launch
from deadpool_ext.policy.effects import Stop


class FakeAgent:
    def __init__(self):
        self.signals = []

    def send_signal(self, sig):
        self.signals.append(sig)


class FakeCoordinator:
    ended = None

    def carry_out(self, effect):
        self.ended = effect


@pytest.mark.parametrize("handler", [True, False])
def test_launcher_sigterm_lets_ranks_save_or_ends_the_job(handler):
    args = ["--exit-signal-handler"] if handler else []
    opts = SimpleNamespace(script_args=["--train-iters", "9", *args])
    coordinator, agent = FakeCoordinator(), FakeAgent()
    launch.on_sigterm(opts, coordinator, {0: agent})
    if handler:
        assert agent.signals == [signal.SIGTERM] and coordinator.ended is None
    else:
        assert agent.signals == [] and isinstance(coordinator.ended, Stop)
