"""Megatron-LM's model, data and memory flags run through pretrain_gpt.py and
do what they say: --rotary-percent changes the model, the flags that only
change how (garbage collection, memory-mapping, the CUDA cache, the
deprecated ones) leave the curve bit for bit as it was."""

import json
import os
import re
import sys

import numpy
import pytest

from dist_utils import (
    captured,
    TINY_GPT,
    curve,
    read_metrics,
    run_pretrain,
    tensorboard_scalars,
    torchrun,
)

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
            *("--profile", "--use-pytorch-profiler", "--profile-step-start", "1"),
            *("--profile-step-end", "3", "--tensorboard-dir", str(tmp_path / "tb")),
            *("--timing-log-level", "2", "--log-timers-to-tensorboard", "--log-interval", "2"),
            # Fusions without a kernel on a CPU, fp32 softmax of fp32 scores, the
            # schedule's source at a load.
            *("--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion"),
            *("--no-gradient-accumulation-fusion", "--attention-softmax-in-fp32"),
            *("--use-checkpoint-opt_param-scheduler", "--log-params-norm"),
            "--log-num-zeros-in-grad",
        ],
        # torch's deterministic kernels: some sum in another order than the
        # default ones (measured: the grad norm 1e-7 relative apart).
        "deterministic": ["--deterministic-mode"],
        "fused-cross-entropy": ["--cross-entropy-loss-fusion"],
        "half-rotary": ["--rotary-percent", "0.5"],
        # Models these flags change (Nemotron-, Qwen- and OLMo-like): they train.
        "no-bias": ["--disable-bias-linear"],
        "qkv-bias-qk-norm": ["--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm"],
        "squared-relu": ["--squared-relu"],
    }
    curves, outputs = {}, {}
    for name, flags in runs.items():
        metrics = tmp_path / f"{name}.jsonl"
        outputs[name] = run_pretrain(1, base + flags + ["--metrics-file", str(metrics)])
        curves[name] = curve(read_metrics(metrics))
    assert len(curves["plain"]) == 4
    assert curves["same"] == curves["plain"]
    # Megatron-LM's fields, after the grad norm, and on the dashboard.
    line = re.search(
        r"grad norm: [\d.]+ \| num zeros: ([\d.]+) \| params norm: ([\d.]+) \|", outputs["same"]
    )
    assert line and float(line.group(1)) >= 0 and float(line.group(2)) > 0, outputs["same"][-2000:]
    scalars = tensorboard_scalars(str(tmp_path / "tb"))
    assert [step for step, _ in scalars["params-norm"]] == [1, 2, 3, 4]
    assert [step for step, _ in scalars["num-zeros"]] == [1, 2, 3, 4]
    plain = curves["plain"]
    for ours, theirs in zip(curves["deterministic"], plain, strict=True):
        assert ours[0] == theirs[0] and ours[3] == theirs[3]  # iteration, lr
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(ours[1:3], theirs[1:3]))
    changed = [tuple(curves[name]) for name in ("no-bias", "qkv-bias-qk-norm", "squared-relu")]
    assert len({tuple(curves["plain"]), *changed}) == 4  # each a model of its own
    for run in changed:
        assert len(run) == 4 and all(abs(loss) < float("inf") for _, loss, *_ in run)
        assert run[-1][1] < run[0][1]  # it learns
    # Megatron-LM's timers after each log line, and on the dashboard.
    assert outputs["same"].count("(min, max) time across ranks (ms):") == 3  # iterations 1, 2, 4
    assert "forward-compute ....." in outputs["same"] and "optimizer ....." in outputs["same"]
    timed = tensorboard_scalars(str(tmp_path / "tb"))["forward-backward-time"]
    assert [step for step, _ in timed] == [1, 2, 4] and all(ms > 0 for _, ms in timed)
    traces = [name for name in os.listdir(tmp_path / "tb") if name.endswith(".pt.trace.json")]
    assert len(traces) == 1  # torch.profiler's, of iterations 2 and 3
    # The fused kernel's forward is the same loss up to its own summation
    # order (1 ulp apart on some CPUs, equal on others); its backward rounds
    # the logits' gradients to bf16 (megatron-core's, made for bf16
    # training), so only the first loss is compared. Control: a real change
    # of the model moves the first loss by far more than those few ulps.
    first = curves["plain"][0][1]
    ulp = float(numpy.spacing(numpy.float32(first)))  # the loss is a float32
    assert abs(curves["fused-cross-entropy"][0][1] - first) <= 4 * ulp
    assert abs(curves["half-rotary"][0][1] - first) > 4 * ulp
    assert curves["half-rotary"] != curves["plain"]


def test_optimizer_and_gradient_flags_change_what_they_say(corpus_prefix, tmp_path):
    """--decoupled-lr at --lr's values is the plain run (the embedding and
    output layer in their own parameter group, the same schedule: only the
    grad norm's sum runs over the groups in another order, measured 1e-7
    relative), at another value it is far from it; the gradient dtype flags
    change the curve of the precision they go with."""
    base = TINY_GPT + ["--train-iters", "4", "--global-batch-size", "4"]
    base += ["--data-path", corpus_prefix, "--split", "98,2,0"]
    runs = {
        "plain": [],
        "decoupled-same": ["--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-4"],
        "decoupled": ["--decoupled-lr", "5e-3"],
        "bf16": ["--bf16"],
        "bf16-grads": ["--bf16", "--grad-reduce-in-bf16"],
        "fp16": ["--fp16"],
        "fp16-fp32-grads": ["--fp16", "--accumulate-allreduce-grads-in-fp32"],
    }
    curves = {}
    for name, flags in runs.items():
        metrics = tmp_path / f"{name}.jsonl"
        run_pretrain(1, base + flags + ["--metrics-file", str(metrics)])
        curves[name] = read_metrics(metrics)
    assert len(curves["plain"]) == 4
    assert drift(curves["decoupled-same"], curves["plain"]) <= 1e-6
    assert drift(curves["decoupled"], curves["plain"]) > 1e-3
    assert curves["bf16-grads"] != curves["bf16"]
    assert curves["fp16-fp32-grads"] != curves["fp16"]


PER_TOKEN_TOLERANCE = 1e-5


def short_documents(corpus_prefix, tmp_path) -> str:
    """Each line of the corpus a document: an end of document every few
    dozen tokens, so --eod-mask-loss leaves microbatches different counts."""
    lines = []
    with open(os.path.join(os.path.dirname(corpus_prefix), "corpus.jsonl")) as f:
        for record in map(json.loads, f):
            lines += [line for line in record["text"].splitlines() if line.strip()]
    source = tmp_path / "short.jsonl"
    source.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines[:4000]))
    prefix = str(tmp_path / "short")
    proc = captured(
        [sys.executable, "tools/preprocess_data.py", "--input", str(source)]
        + ["--output-prefix", prefix, "--tokenizer-type", "ByteLevelTokenizer", "--append-eod"],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return prefix + "_text_document"


def drift(a, b) -> float:
    """Largest relative difference of loss and grad norm between two runs' records."""
    return max(abs(x[k] - y[k]) / abs(y[k]) for x, y in zip(a, b) for k in ("lm_loss", "grad_norm"))


def test_per_token_loss_divides_by_the_tokens_of_the_whole_global_batch(corpus_prefix, tmp_path):
    """With --eod-mask-loss microbatches hold different numbers of loss
    tokens. --calculate-per-token-loss divides the summed gradients by the
    tokens of all replicas: two replicas of two microbatches train as one
    rank of four, up to the order of fp32 sums (measured 1e-7 relative; we
    allow 1e-5). The default, a mean over each microbatch's tokens, moves the
    curve past that (measured 3.6e-4): the negative control."""
    data = short_documents(corpus_prefix, tmp_path)
    base = TINY_GPT + ["--train-iters", "6", "--global-batch-size", "8", "--eod-mask-loss"]
    base += ["--data-path", data, "--split", "98,2,0", "--seq-length", "64"]
    base += ["--hidden-dropout", "0", "--attention-dropout", "0"]
    runs = {
        "dp1": (1, ["--calculate-per-token-loss"]),
        "dp2": (2, ["--calculate-per-token-loss"]),
        "dp2-mean": (2, []),
    }
    metrics = {}
    for name, (ranks, flags) in runs.items():
        path = tmp_path / f"{name}.jsonl"
        run_pretrain(ranks, base + flags + ["--metrics-file", str(path)])
        metrics[name] = read_metrics(path)

    assert len(metrics["dp1"]) == 6
    assert drift(metrics["dp2"], metrics["dp1"]) <= PER_TOKEN_TOLERANCE
    assert drift(metrics["dp2-mean"], metrics["dp1"]) > 10 * PER_TOKEN_TOLERANCE


def test_a_nan_loss_stops_the_run_unless_the_check_is_off():
    """--check-for-nan-in-loss-and-grad (Megatron-LM's default): a learning
    rate of 1e9 turns the loss NaN in iteration 2; megatron-core's validation
    rejects it, the iteration is rerun in place (--rerun-mode's default) and
    the rank stops there with the rerun state machine's exit code; with the
    check off the run goes on and counts NaN iterations, as Megatron-LM."""
    # (argparse takes a repeated flag's last value: TINY_GPT's are overridden)
    args = TINY_GPT + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
    args += ["--lr", "1e9", "--train-iters", "5", "--global-batch-size", "2"]
    checked = torchrun(1, args)
    stopped = re.search(
        r"Unexpected result nan on rank 0 at iteration #(\d) invocation #1 \(message='found "
        r"NaN in local forward loss calculation'\)",
        checked.stderr,
    )
    assert checked.returncode != 0 and stopped, checked.stderr[-3000:]
    assert "Need to rerun step to check reproducibility" in checked.stderr
    # Reproducible: 16, resume elsewhere to tell a faulty GPU from a bug (as Megatron-LM).
    assert re.search(r"exitcode\s*: 16 ", checked.stderr), checked.stderr[-3000:]
    unchecked = torchrun(1, args + ["--no-check-for-nan-in-loss-and-grad"])
    assert unchecked.returncode == 0, unchecked.stderr[-3000:]
    nan_from = int(stopped.group(1))  # the same run: NaN from that iteration on
    counts = re.findall(r"number of nan iterations: +(\d+) \|", unchecked.stdout)
    assert counts == ["0"] * (nan_from - 1) + ["1"] * (5 - nan_from + 1)  # one per log line
