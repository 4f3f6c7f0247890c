"""--train-samples and the schedule in samples, as Megatron-LM: whole
global batches, schedule lengths in samples, one unit at a time, and a run
given in samples equal to the same run given in iterations."""

import pytest

from dist_utils import TINY_GPT, curve, read_metrics, run_pretrain
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


@pytest.mark.integration
def test_a_run_in_samples_equals_the_same_run_in_iterations(corpus_prefix, tmp_path):
    common = TINY_GPT + [
        "--data-path",
        corpus_prefix,
        "--split",
        "98,2,0",
        "--global-batch-size",
        "8",
    ]
    runs = {
        "iters": ["--train-iters", "6", "--lr-warmup-iters", "2", "--lr-decay-iters", "5"],
        "samples": [
            "--train-samples",
            "50",
            "--lr-warmup-iters",  # TINY_GPT's, in iterations
            "0",
            "--lr-warmup-samples",
            "16",
            "--lr-decay-samples",
            "40",
        ],
    }
    runs["control"] = [f if f != "16" else "12" for f in runs["samples"]]
    curves = {}
    for name, flags in runs.items():
        metrics = tmp_path / f"{name}.jsonl"
        run_pretrain(2, common + flags + ["--metrics-file", str(metrics)])
        curves[name] = curve(read_metrics(metrics))
    assert len(curves["iters"]) == 6  # 50 samples: 6 whole batches of 8
    assert curves["samples"] == curves["iters"]
    assert curves["control"] != curves["iters"]  # the warm-up in samples is read
