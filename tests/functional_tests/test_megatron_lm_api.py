"""Megatron-LM's training API (megatron/training/megatron_lm.py, utils.py)
driving real ranks: a script written against it (megatron_lm_script.py, every
call of the API this build offers) runs unchanged on 8 ranks as under torchrun,
and with --deadpool under deadpool-launch, where a node is killed and the curve
and every rank's final state equal the failure-free run's bit for bit."""

import os

import pytest

from dist_utils import (
    captured,
    assert_same_run,
    forkrun,
    launch_command,
    leftovers,
    read_metrics,
)

pytestmark = pytest.mark.integration

SCRIPT = os.path.join("tests", "common", "megatron_lm_script.py")
# TP2 x PP2 x DP2 on 8 ranks (DP peers on different nodes of 4 under deadpool-launch).
FLAGS = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8"),
    *("--lr", "1e-3", "--lr-warmup-iters", "2", "--train-iters", "6", "--log-interval", "1"),
    *("--eval-iters", "0", "--split", "98,2,0", "--tokenizer-type", "ByteLevelTokenizer"),
    *("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
    *("--use-tp-pp-dp-mapping", "--use-distributed-optimizer", "--num-workers", "0"),
]


def test_a_megatron_lm_script_trains_on_8_ranks_as_under_torchrun(tmp_path, corpus_prefix):
    metrics = tmp_path / "metrics.jsonl"
    flags = FLAGS + ["--data-path", corpus_prefix, "--metrics-file", str(metrics)]
    proc = forkrun(8, flags, script=SCRIPT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "building GPT model ..." in proc.stdout  # its print_rank_0, once
    assert proc.stdout.count("building GPT model ...") == 1
    losses = [m["lm_loss"] for m in read_metrics(metrics)]
    assert len(losses) == 6 and losses[-1] < losses[0]


def launch(tmp, corpus, spares, faults):
    args = FLAGS + ["--data-path", corpus, "--save", str(tmp / "ckpt")]
    args += ["--metrics-file", str(tmp / "metrics.jsonl"), "--deadpool"]
    args += ["--deadpool-events", str(tmp / "events.jsonl"), "--deadpool-heartbeat-timeout", "5"]
    args += [f"--deadpool-inject={fault}" for fault in faults]
    launcher = ["--standalone", "--nnodes", "2", "--spare-nodes", str(spares)]
    launcher += ["--nproc-per-node", "4"]
    proc = captured(launch_command(launcher, args, script=SCRIPT), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert not leftovers(tmp)


def test_a_megatron_lm_script_recovers_under_deadpool_launch_bit_for_bit(tmp_path, corpus_prefix):
    """Node 1 (the second pipeline stage of both replicas) is killed in
    backward of iteration 3: the spare node's ranks build the script's
    datasets and model through its own providers and take the ranks over."""
    reference, recovered = tmp_path / "reference", tmp_path / "recovered"
    launch(reference, corpus_prefix, 0, [])
    launch(recovered, corpus_prefix, 1, ["kill:node=1:iter=3:phase=backward"])
    assert_same_run(recovered, reference, 6)
    events = (recovered / "events.jsonl").read_text()
    assert '"event": "recovered"' in events
