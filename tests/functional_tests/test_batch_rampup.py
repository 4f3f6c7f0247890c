"""--rampup-batch-size as Megatron-LM, in real runs: a checkpoint is saved
before each larger batch, and the batch is a function of the samples
consumed, so a resumed run and a shrunk one (fewer replicas, uneven quotas)
take the failure-free run's batches. (The ramp itself, in-process, is in
tests/unit_tests/training/test_schedule.py.)

The shrink test's tolerance is test_shrink.py's (its docstring says why
1e-5 relative, fifty times the fp32 reordering measured there), and its
negative control there (a wrong quota weighting) applies here unchanged."""

import json
import os

import pytest

from dist_utils import (
    TINY_GPT,
    curve,
    launch_deadpool,
    must_succeed,
    read_metrics,
    run_pretrain,
    tensorboard_scalars,
)
from tests.unit_tests.training.test_schedule import RAMP, RAMP_SIZES

pytestmark = pytest.mark.integration


def ramped_run(corpus_prefix, directory, *flags):
    directory.mkdir(parents=True, exist_ok=True)
    args = TINY_GPT + RAMP + ["--lr-warmup-iters", "0", "--lr-warmup-samples", "8"]
    args += ["--data-path", corpus_prefix, "--save", str(directory / "ckpt")]
    args += ["--metrics-file", str(directory / "metrics.jsonl"), *flags]
    return run_pretrain(2, args)


def test_a_ramped_run_saves_at_each_step_and_resumes_across_one_bit_for_bit(
    corpus_prefix, tmp_path
):
    output = ramped_run(corpus_prefix, tmp_path / "full", "--tensorboard-dir", str(tmp_path / "tb"))
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    consumed = [m["consumed_samples"] for m in full]
    assert [b - a for a, b in zip([0] + consumed, consumed)] == RAMP_SIZES
    assert "global batch size:    12 |" in output
    # Megatron-LM saves before the first iteration of each larger batch.
    saved = sorted(
        name for name in os.listdir(tmp_path / "full" / "ckpt") if name.startswith("iter_")
    )
    assert saved == ["iter_0000004", "iter_0000006", "iter_0000007", "iter_0000011"]
    sizes = [value for _, value in tensorboard_scalars(str(tmp_path / "tb"))["batch-size"]]
    assert sizes == RAMP_SIZES

    # Stopped after iteration 5 (in the middle of the ramp), then resumed.
    ramped_run(corpus_prefix, tmp_path / "split", "--exit-interval", "5")
    ramped_run(corpus_prefix, tmp_path / "split", "--load", str(tmp_path / "split" / "ckpt"))
    resumed = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert curve(resumed) == curve(full)


TOLERANCE = 1e-5  # test_shrink.py's, for the same reason
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
DP4 = ["--pipeline-model-parallel-size", "2", "--use-tp-pp-dp-mapping"] + NO_DROPOUT
# 8 -> 24 by 8 over 48 samples: batches 8, 8, 8, 16, 16, then 24 (4, 8, 12
# microbatches: after a shrink to 3 replicas, quotas 2/1/1, 3/3/2, 4/4/4).
DEADPOOL_RAMP = ["--train-samples", "224", "--global-batch-size", "24"]
DEADPOOL_RAMP += ["--rampup-batch-size", "8", "8", "48"]
DEADPOOL_RAMP += ["--lr-warmup-iters", "0", "--lr-warmup-samples", "16"]
DEADPOOL_SIZES = [8, 8, 8, 16, 16] + [24] * 7


def test_a_job_shrunk_in_the_ramp_keeps_every_iterations_batch_and_the_curve(
    tmp_path, corpus_prefix
):
    os.environ["HOT_SWAP_CORPUS"] = corpus_prefix
    runs = {}
    for name, faults in (("reference", []), ("shrunk", ["kill:rank=5:iter=2:phase=backward"])):
        must_succeed(
            launch_deadpool(tmp_path / name, DP4, 2, 0, 4, faults, 12, schedule=DEADPOOL_RAMP)
        )
        runs[name] = read_metrics(tmp_path / name / "metrics.jsonl")
    want, got = runs["reference"], runs["shrunk"]
    consumed = [m["consumed_samples"] for m in want]
    assert [b - a for a, b in zip([0] + consumed, consumed)] == DEADPOOL_SIZES
    assert [m["iteration"] for m in got] == list(range(1, 13))
    for g, w in zip(got, want):
        assert (g["consumed_samples"], g["lr"]) == (w["consumed_samples"], w["lr"])
        for key in ("lm_loss", "grad_norm"):
            assert abs(g[key] - w[key]) <= TOLERANCE * abs(w[key]), (g, w)
    with open(tmp_path / "shrunk" / "events.jsonl") as f:
        decisions = [e for e in map(json.loads, f) if e["event"] == "decision"]
    assert [(d["action"], d["dp_before"], d["dp_after"]) for d in decisions] == [("shrink", 4, 3)]
