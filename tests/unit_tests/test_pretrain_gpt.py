"""pretrain_gpt.py's forward step, in-process: megatron-core's combined 1F1B
schedule gets the model's schedule plan from it."""

from functools import partial

from megatron.training import cpu_compat

cpu_compat.import_megatron_core_without_cuda()  # import-time only

import pretrain_gpt  # noqa: E402


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
