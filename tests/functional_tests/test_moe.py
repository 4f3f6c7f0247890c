"""Mixture of experts through pretrain_gpt.py on CPU ranks: the same model
whatever the expert-parallel layout and dispatcher, Megatron-LM's
auxiliary-loss log, and checkpoints that resume bit for bit (and at another
expert-parallel size, and with a DeepSeek-style model on two stages)."""

import os

import pytest

from dist_utils import (
    assert_same_state,
    checkpoint_state,
    curve,
    read_metrics,
    run_pretrain,
    tensorboard_scalars,
)
from tests.unit_tests.training.flags.test_moe import BASE, MOE

pytestmark = pytest.mark.integration

# --- runs on 4 CPU ranks ------------------------------------------------------------

RUN = BASE + MOE + ["--use-distributed-optimizer", "--log-interval", "1", "--eval-iters", "0"]
RUN += ["--num-workers", "0", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]


def moe_run(tmp, *extra: str, invariant: bool = True) -> dict:
    """A 4-rank MoE run in ``tmp``: its stdout, metrics and saves."""
    tmp.mkdir(parents=True, exist_ok=True)
    args = RUN + ["--metrics-file", str(tmp / "metrics.jsonl"), *extra]
    args += ["--layout-invariant-init"] if invariant else []
    out = run_pretrain(4, args)
    return {"out": out, "metrics": read_metrics(str(tmp / "metrics.jsonl")), "dir": tmp}


@pytest.fixture(scope="module")
def ep2(tmp_path_factory):
    """The reference: EP 2, all-to-all, saved at 3 and 6, with TensorBoard."""
    tmp = tmp_path_factory.mktemp("moe_ep2")
    return moe_run(
        tmp,
        "--expert-model-parallel-size",
        "2",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--save",
        str(tmp / "ckpt"),
        "--save-interval",
        "3",
        "--dist-ckpt-optim-fully-reshardable",
        "--tensorboard-dir",
        str(tmp / "tb"),
    )


def losses(run) -> list:
    return [m["lm_loss"] for m in run["metrics"]]


def relative_gap(a: list, b: list) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_the_dispatchers_give_the_same_model_bit_for_bit(ep2, tmp_path):
    allgather = moe_run(tmp_path, "--expert-model-parallel-size", "2")
    assert curve(allgather["metrics"]) == curve(ep2["metrics"])
    assert losses(ep2)[-1] < losses(ep2)[0]  # and it learns


def test_the_expert_parallel_layout_does_not_change_the_model(ep2, tmp_path):
    """EP 4 (one expert per rank) trains the EP 2 model: the same losses to
    rounding (gradients are reduced over other groups). Control: without
    the layout-invariant initialisation the experts start elsewhere."""
    ep4 = moe_run(tmp_path / "ep4", "--expert-model-parallel-size", "4")
    assert len(ep4["metrics"]) == 6 and relative_gap(losses(ep4), losses(ep2)) < 1e-5
    control = moe_run(tmp_path / "control", "--expert-model-parallel-size", "4", invariant=False)
    assert relative_gap(losses(control), losses(ep2)) > 1e-3


def test_the_auxiliary_losses_are_logged_as_megatron_lm(ep2):
    lines = [line for line in ep2["out"].splitlines() if " iteration " in line]
    assert len(lines) == 6
    for line in lines:  # Megatron-LM's order: the lm loss, then the router's losses
        assert line.index("lm loss:") < line.index("z_loss:")
        assert line.index("lm loss:") < line.index("load_balancing_loss:")
    scalars = tensorboard_scalars(str(ep2["dir"] / "tb"))
    balance = scalars["load_balancing_loss"]
    assert [step for step, _ in balance] == list(range(1, 7))
    printed = float(lines[-1].split("load_balancing_loss:")[1].split("|")[0])
    assert balance[-1][1] == pytest.approx(printed, rel=1e-6)
    # A balanced router gives about 1 (Switch's loss is topk-normalised).
    assert all(0.5 < value < 2 for _, value in balance)


def resume_from_iteration_3(ep2, tmp, *extra: str) -> dict:
    """The reference's iteration-3 save, resumed in ``tmp`` up to 6."""
    ckpt = tmp / "ckpt"
    ckpt.mkdir(parents=True)
    os.symlink(ep2["dir"] / "ckpt" / "iter_0000003", ckpt / "iter_0000003")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    saving = ["--save", str(ckpt), "--save-interval", "3", "--dist-ckpt-optim-fully-reshardable"]
    return moe_run(tmp, "--load", str(ckpt), *saving, *extra)


def test_a_moe_checkpoint_resumes_bit_for_bit(ep2, tmp_path):
    layout = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
    same = resume_from_iteration_3(ep2, tmp_path, *layout)
    assert curve(same["metrics"]) == curve(ep2["metrics"])[3:]
    assert_same_state(
        checkpoint_state(str(ep2["dir"] / "ckpt"), 6), checkpoint_state(str(tmp_path / "ckpt"), 6)
    )


def test_a_moe_checkpoint_resumes_at_another_expert_parallel_size(ep2, tmp_path):
    """Saved fully reshardable at EP 2, dist_checkpointing cuts the experts
    and their optimizer state again for EP 4: training goes on as the
    uninterrupted run, to rounding. Control: without the optimizer state."""
    ep4 = resume_from_iteration_3(ep2, tmp_path / "ep4", "--expert-model-parallel-size", "4")
    assert [m["iteration"] for m in ep4["metrics"]] == [4, 5, 6]
    assert relative_gap(losses(ep4), losses(ep2)[3:]) < 1e-5
    fresh_optimizer = resume_from_iteration_3(
        ep2, tmp_path / "control", "--expert-model-parallel-size", "4", "--no-load-optim"
    )
    assert relative_gap(losses(fresh_optimizer)[1:], losses(ep2)[4:]) > 1e-3


DEEPSEEK_STYLE = ["--pipeline-model-parallel-size", "2", "--untie-embeddings-and-output-weights"]
DEEPSEEK_STYLE += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
DEEPSEEK_STYLE += ["--moe-router-bias-update-rate", "1e-2", "--moe-layer-freq", "[0,1]"]
DEEPSEEK_STYLE += ["--moe-router-num-groups", "2", "--moe-router-group-topk", "1"]
DEEPSEEK_STYLE += ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]


def test_a_deepseek_style_checkpoint_resumes_bit_for_bit(tmp_path):
    """A dense first layer, an MoE second, a multi-token prediction layer
    on the last of two stages, expert biases that move every iteration:
    saved at 3 and resumed, the curve (MTP's loss in it) and the state (the
    biases in it) are the uninterrupted run's."""

    def two_stages(tmp, *extra):
        tmp.mkdir(parents=True, exist_ok=True)
        args = RUN + DEEPSEEK_STYLE + ["--metrics-file", str(tmp / "metrics.jsonl"), *extra]
        args += ["--save", str(tmp / "ckpt"), "--save-interval", "3"]
        run_pretrain(2, args)
        return read_metrics(str(tmp / "metrics.jsonl"))

    whole = two_stages(tmp_path / "whole")
    assert all(m["mtp_1 loss"] > 0 for m in whole)
    resumed_dir = tmp_path / "resumed" / "ckpt"
    resumed_dir.mkdir(parents=True)
    os.symlink(tmp_path / "whole" / "ckpt" / "iter_0000003", resumed_dir / "iter_0000003")
    (resumed_dir / "latest_checkpointed_iteration.txt").write_text("3")
    resumed = two_stages(tmp_path / "resumed", "--load", str(resumed_dir))
    assert curve(resumed) == curve(whole)[3:]
    final = checkpoint_state(str(tmp_path / "whole" / "ckpt"), 6)
    assert_same_state(checkpoint_state(str(resumed_dir), 6), final)
    # Layer 2's and MTP's biases moved (an oscillating one can be back at 0 at 6).
    saved = [checkpoint_state(str(tmp_path / "whole" / "ckpt"), i) for i in (3, 6)]
    moved = {k for state in saved for k, v in state.items() if "expert_bias" in k and v.any()}
    assert len(moved) == 2, moved
