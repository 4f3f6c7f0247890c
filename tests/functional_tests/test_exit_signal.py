"""--exit-signal-handler: SIGTERM to one rank makes every rank save a
consistent checkpoint at the same iteration and exit cleanly."""

import os
import signal
import subprocess
import time

import pytest

from dist_utils import TINY_GPT, corpus_run, saved_args, read_metrics, torchrun_command, worker_env

# Every test here starts real processes.
pytestmark = pytest.mark.integration


def children(pid: int):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def wait_for_iterations(path, count, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(path) and len(read_metrics(path)) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {count} iterations within {timeout} s")


def run_until_sigterm(command, metrics, send_sigterm, **popen) -> subprocess.CompletedProcess:
    """``command`` run until it has trained 3 iterations, then sent SIGTERM
    by ``send_sigterm(proc)`` and waited for."""
    proc = subprocess.Popen(command, env=worker_env(), stdout=subprocess.PIPE, text=True, **popen)
    try:
        wait_for_iterations(metrics, 3, proc)
        send_sigterm(proc)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def test_sigterm_saves_and_exits_cleanly(tmp_path, corpus_prefix):
    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    args = TINY_GPT + [
        "--use-distributed-optimizer",
        *corpus_run(tmp_path, corpus_prefix, 1000, global_batch=4),
        "--exit-signal-handler",
        "--save",
        str(ckpt),
    ]

    def sigterm_one_rank(proc):
        workers = children(proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGTERM)  # one rank only, as a node's SIGTERM might

    command = torchrun_command(2, args)
    proc = run_until_sigterm(command, metrics, sigterm_one_rank, stderr=subprocess.PIPE)
    assert proc.returncode == 0, proc.stderr[-4000:]
    done = read_metrics(metrics)
    assert 3 <= len(done) < 1000
    saved = saved_args(str(ckpt))
    assert saved.world_size == 2
    assert saved.iteration == done[-1]["iteration"]
    assert saved.consumed_train_samples == done[-1]["consumed_samples"]


def test_sigterm_under_deadpool_launch_saves_once_and_skips_final_validation(
    tmp_path, corpus_prefix
):
    """Slurm's --signal reaches the launcher: every rank saves the same
    iteration once and stops, without the end-of-training validation and
    save (which would eat into the --signal window)."""
    import sys
    from dist_utils import REPO

    metrics, ckpt = tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    args = TINY_GPT + [
        "--use-distributed-optimizer",
        *corpus_run(tmp_path, corpus_prefix, 1000, global_batch=4),
        # 969,30,1 leaves the small corpus's test split no document (refused:
        # megatron-core would loop forever building it)
        "--split",
        "98,1,1",
        "--eval-interval",
        "1000",
        "--eval-iters",
        "2",
        "--exit-signal-handler",
        "--save",
        str(ckpt),
        "--deadpool",
    ]
    command = [
        sys.executable,
        "-m",
        "deadpool_ext.launch",
        "--standalone",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        os.path.join(REPO, "pretrain_gpt.py"),
        *args,
    ]
    proc = run_until_sigterm(
        command,
        metrics,
        lambda launcher: launcher.send_signal(signal.SIGTERM),
        cwd=REPO,
        stderr=subprocess.STDOUT,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    done = read_metrics(metrics)
    saved = saved_args(str(ckpt))
    assert saved.world_size == 2 and saved.iteration == done[-1]["iteration"]
    assert out.count("saved checkpoint") == 2, out[-4000:]
    assert "on validation set" not in out, out[-4000:]  # no final validation
