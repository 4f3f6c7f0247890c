"""Megatron-LM's model, data and memory flags run through pretrain_gpt.py and
do what they say: --rotary-percent changes the model, the flags that only
change how (garbage collection, memory-mapping, the CUDA cache, the
deprecated ones) leave the curve bit for bit as it was."""

import pytest

from dist_utils import TINY_GPT, curve, read_metrics, run_pretrain

pytestmark = pytest.mark.integration


def test_megatron_lms_flags_run_and_change_only_what_they_say(corpus_prefix, tmp_path):
    rope = ["--position-embedding-type", "rope", "--train-iters", "4", "--global-batch-size", "4"]
    base = TINY_GPT + rope + ["--data-path", corpus_prefix, "--split", "98,2,0"]
    runs = {
        "plain": [],
        "same": [
            *("--manual-gc", "--manual-gc-interval", "2", "--no-mmap-bin-files"),
            *("--no-create-attention-mask-in-dataloader", "--empty-unused-memory-level", "2"),
            *("--use-mcore-models", "--no-position-embedding", "--no-masked-softmax-fusion"),
            *("--attention-backend", "local", "--rotary-percent", "1.0"),
        ],
        "half-rotary": ["--rotary-percent", "0.5"],
    }
    curves = {}
    for name, flags in runs.items():
        metrics = tmp_path / f"{name}.jsonl"
        run_pretrain(1, base + flags + ["--metrics-file", str(metrics)])
        curves[name] = curve(read_metrics(metrics))
    assert len(curves["plain"]) == 4
    assert curves["same"] == curves["plain"]
    assert curves["half-rotary"] != curves["plain"]
