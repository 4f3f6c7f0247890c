"""--rampup-batch-size as Megatron-LM: the global batch grows from START
by INCREMENT over SAMPLES samples (megatron-core's calculator), the run's
iterations are counted as Megatron-LM counts them, a checkpoint is saved
before each larger batch, and the batch is a function of the samples
consumed, so a resumed run and a shrunk one (fewer replicas, uneven
quotas) take the failure-free run's batches.

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
from megatron.core import num_microbatches_calculator as calculator
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.data import MicrobatchSampler
from megatron.training.schedule import GlobalBatch

BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"]
BASE += ["--seq-length", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data"]
BASE += ["--tokenizer-type", "ByteLevelTokenizer"]
# 4 -> 16 by 4 over 40 samples (13.3 a step), 120 samples in all.
RAMP = [
    "--train-samples",
    "120",
    "--global-batch-size",
    "16",
    "--rampup-batch-size",
    "4",
    "4",
    "40",
]
RAMP_SIZES = [4, 4, 4, 4, 8, 8, 12, 16, 16, 16, 16]


def config(*flags, world_size=2):
    return parse_args(BASE + list(flags), world_size=world_size)


def test_the_ramp_and_the_iteration_count_are_megatron_lms():
    c = config(*RAMP)
    # Megatron-LM's loop: ramp iterations while at most 40 samples are
    # consumed (the last one passes them: 32 + 12 = 44), then (120 - 44) // 16.
    assert c.training.train_iters == 7 + 4
    batch, consumed, sizes = GlobalBatch(c), 0, []
    calculator.unset_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(0, [4, 4, 40], 16, 2, 2)
    try:
        for _ in range(c.training.train_iters):
            calculator.update_num_microbatches(consumed, consistency_check=True)
            assert batch.at(consumed) == calculator.get_current_global_batch_size()
            sizes.append(batch.at(consumed))
            consumed += sizes[-1]
    finally:
        calculator.unset_num_microbatches_calculator()
    assert sizes == RAMP_SIZES
    assert GlobalBatch(c).steps() == [4, 8, 12, 16]
    assert GlobalBatch(config("--train-iters", "5", "--global-batch-size", "8")).steps() == [8]


def test_a_shrunk_replica_set_takes_every_sample_of_each_ramped_iteration_once():
    c = config(*RAMP)
    batch_at = GlobalBatch(c).at
    for dp in (1, 2, 3):  # 3: uneven quotas of 2, 4, 6 and 8 microbatches
        seen = sorted(
            i for r in range(dp) for mb in MicrobatchSampler(120, 0, 2, r, dp, batch_at) for i in mb
        )
        assert seen == list(range(sum(RAMP_SIZES)))  # 108: a 12th batch would pass 120
    # Resumed at the start of any iteration, a rank reads what it would have.
    starts = [sum(RAMP_SIZES[:k]) for k in range(len(RAMP_SIZES))]
    for start in starts[:8]:
        full = [mb for mb in MicrobatchSampler(120, 0, 2, 1, 3, batch_at) if mb[0] >= start]
        assert list(MicrobatchSampler(120, start, 2, 1, 3, batch_at)) == full
    # With even quotas the order is Megatron-LM's sequential one.
    for r in range(2):
        assert list(MicrobatchSampler(108, 0, 2, r, 2, batch_at)) == list(
            MicrobatchSampler(108, 0, 2, r, 2)
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--train-iters", "10"] + RAMP[2:],
            "--rampup-batch-size goes with --train-samples",
        ),
        (RAMP[:-3] + ["16", "4", "40"], "give a start between 0 and --global-batch-size 16"),
        (RAMP[:-3] + ["4", "5", "40"], "increment 5 must be positive and divide"),
        (RAMP[:-3] + ["4", "4", "0"], "ramp of 0 samples must be positive"),
        # 6 is not a multiple of micro-batch 2 x DP 2
        (RAMP[:-3] + ["6", "2", "40"], r"reaches batch sizes \[6, 10, 14\]"),
    ],
)
def test_a_ramp_megatron_core_would_reject_is_refused_before_training(flags, message):
    with pytest.raises(ConfigError, match=message):
        config(*flags)


# --- real runs ---------------------------------------------------------------------------


def ramped_run(corpus_prefix, directory, *flags):
    directory.mkdir(parents=True, exist_ok=True)
    args = TINY_GPT + RAMP + ["--lr-warmup-iters", "0", "--lr-warmup-samples", "8"]
    args += ["--data-path", corpus_prefix, "--save", str(directory / "ckpt")]
    args += ["--metrics-file", str(directory / "metrics.jsonl"), *flags]
    return run_pretrain(2, args)


@pytest.mark.integration
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


@pytest.mark.integration
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
