"""--train-samples and the schedule in samples, as Megatron-LM, in-process:
whole global batches, schedule lengths in samples, and one unit at a time.
The real runs (a run given in samples equal to the same run given in
iterations) are in tests/functional_tests/test_schedule.py."""

import pytest

from megatron.training.arguments import ConfigError, parse_args
from megatron.training.schedule import schedule_in_samples

BASE = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"]
BASE += ["--seq-length", "8", "--micro-batch-size", "2", "--global-batch-size", "8"]
BASE += ["--lr", "1e-3", "--mock-data", "--tokenizer-type", "ByteLevelTokenizer"]


def config(*flags):
    return parse_args(BASE + list(flags), world_size=2)


def test_train_samples_are_whole_global_batches_and_the_schedule_is_in_samples():
    c = config("--train-samples", "100", "--lr-warmup-samples", "12", "--lr-decay-samples", "90")
    assert c.training.train_iters == 12  # 100 // 8: the partial last batch is dropped
    steps = schedule_in_samples(c)
    assert (steps["warmup"], steps["decay"], steps["total"]) == (12, 90, 100)
    assert schedule_in_samples(config("--train-samples", "100"))["decay"] == 100
    fraction = schedule_in_samples(config("--train-samples", "100", "--lr-warmup-fraction", "0.05"))
    assert fraction["warmup"] == 0.05 * 100  # not rounded, as Megatron-LM
    iters = schedule_in_samples(config("--train-iters", "12", "--lr-warmup-iters", "2"))
    assert (iters["warmup"], iters["decay"], iters["total"]) == (16, 96, 96)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--train-samples", "100", "--lr-warmup-iters", "2"],
            "--lr-warmup-iters goes with --train-iters",
        ),
        (
            ["--train-samples", "100", "--lr-decay-iters", "9"],
            "--lr-decay-iters goes with --train-iters",
        ),
        (
            ["--train-iters", "10", "--lr-decay-samples", "9"],
            "--lr-decay-samples goes with --train-samples",
        ),
        (
            ["--train-iters", "10", "--train-samples", "80"],
            "exactly one of --train-iters and --train-samples",
        ),
        (["--train-samples", "7"], "less than one global batch"),
        (
            ["--train-samples", "100", "--lr-warmup-samples", "200"],
            "lower --lr-warmup-samples or raise --lr-decay-samples",
        ),
    ],
)
def test_the_two_units_do_not_mix(flags, message):
    with pytest.raises(ConfigError, match=message):
        config(*flags)
