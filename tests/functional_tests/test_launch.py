"""deadpool-launch (deadpool_ext/control/launch.py) starting real jobs: a
module given with ``-m`` trains, as torchrun's would run it, and
--exit-on-missing-checkpoint ends a job cleanly with and without deadpool.
The command line's parsing is tested in
tests/unit_tests/control/test_command_line.py."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def deadpool_launch(*words: str) -> subprocess.CompletedProcess:
    """deadpool-launch with ``words``, from the repository, to its end."""
    from dist_utils import captured

    return captured([sys.executable, "-m", "deadpool_ext.launch", *words], timeout=300)


def test_a_job_started_with_m_trains(tmp_path, corpus_prefix):
    """``-m pretrain_gpt``: the workers (forked from their node's zygote on a
    CPU) run the module as python -m would."""
    from dist_utils import TINY_GPT, read_metrics

    metrics = tmp_path / "metrics.jsonl"
    args = TINY_GPT + ["--global-batch-size", "4", "--train-iters", "3", "--data-path"]
    args += [corpus_prefix, "--use-distributed-optimizer", "--deadpool"]
    args += ["--metrics-file", str(metrics)]
    launcher = ["--standalone", "--nnodes", "2", "--nproc-per-node", "1", "-m", "pretrain_gpt"]
    proc = deadpool_launch(*launcher, *args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [m["iteration"] for m in read_metrics(metrics)] == [1, 2, 3]


def test_exit_on_missing_checkpoint_ends_the_job_cleanly(tmp_path, corpus_prefix):
    """Nothing in --load and --exit-on-missing-checkpoint: exit code 0 and
    Megatron-LM's line, without deadpool (torchrun) and with it (every rank
    done, the spare node stopped), before any iteration."""
    from dist_utils import TINY_GPT, torchrun

    args = TINY_GPT + ["--global-batch-size", "4", "--train-iters", "3", "--data-path"]
    args += [corpus_prefix, "--use-distributed-optimizer", "--metrics-file"]
    args += [str(tmp_path / "metrics.jsonl"), "--load", str(tmp_path / "empty")]
    args += ["--exit-on-missing-checkpoint"]
    said = "--exit-on-missing-checkpoint is set: exiting"
    plain = torchrun(1, args, timeout=300)
    assert plain.returncode == 0 and said in plain.stdout, plain.stdout[-2000:] + plain.stderr
    launcher = ["--standalone", "--nnodes", "2", "--spare-nodes", "1", "--nproc-per-node", "1"]
    proc = deadpool_launch(*launcher, "pretrain_gpt.py", *args, "--deadpool")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert said in proc.stdout + proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
