"""--train-samples as Megatron-LM, in real runs: a run given in samples
equals the same run given in iterations, and the warm-up in samples is
read. (The schedule itself, in-process, is in
tests/unit_tests/training/test_schedule.py.)"""

import pytest

from dist_utils import TINY_GPT, curve, read_metrics, run_pretrain

pytestmark = pytest.mark.integration


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
