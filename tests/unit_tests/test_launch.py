"""deadpool-launch's command line (deadpool_ext/control/launch.py): torchrun's
spellings that make sense for a job with warm spares are taken, the others
refused with the reason; ``-m`` runs a module, as torchrun's."""

import subprocess
import sys

import pytest

from megatron.training.arguments import ConfigError

from deadpool_ext.control.launch import build_parser, check, worker_command

SCRIPT = ["pretrain_gpt.py", "--num-layers", "2"]


def parsed(*flags):
    opts = build_parser().parse_args([*flags, *SCRIPT])
    check(opts)
    return opts


def refusal(*flags) -> str:
    with pytest.raises(ConfigError) as stopped:
        parsed(*flags)
    return str(stopped.value)


def test_torchruns_rendezvous_spellings_name_node_0(capsys, monkeypatch):
    monkeypatch.setenv("DEADPOOL_SECRET", "s")
    opts = parsed("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node7:29500")
    assert (opts.master_addr, opts.master_port) == ("node7", 29500)
    opts = parsed("--rdzv_endpoint", "node7", "--rdzv_id", "job42")
    assert opts.master_port == 29400  # torchrun's default port
    assert "--rdzv-id job42 has no effect here" in capsys.readouterr().err
    opts = parsed("--rdzv-endpoint", "[fd00::7]:29501")
    assert (opts.master_addr, opts.master_port) == ("fd00::7", 29501)
    assert parsed("--nnodes", "2:2", "--rdzv-endpoint", "[fd00::7]").nnodes == 2  # fixed size


def test_nproc_per_node_takes_torchruns_words():
    cores = __import__("os").cpu_count()
    assert parsed("--standalone", "--nproc-per-node", "cpu").nproc_per_node == cores
    assert parsed("--standalone", "--nproc_per_node", "auto").nproc_per_node == cores  # no GPU here
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--nproc-per-node", "gpu", *SCRIPT])


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--max-restarts", "3"], "never restarts the job"),
        (["--rdzv-backend", "etcd"], "give c10d"),
        (["--log-dir", "/tmp/x"], "no per-rank log files"),
        (["--tee", "3"], "no per-rank log files"),
    ],
)
def test_what_torchrun_does_otherwise_is_refused_with_the_reason(flags, words):
    assert words in refusal("--standalone", *flags)


def test_elastic_nnodes_is_refused_with_what_deadpool_does_instead(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--nnodes", "1:4", *SCRIPT])
    assert "--spare-nodes" in capsys.readouterr().err
    assert parsed("--standalone", "--max-restarts", "0").max_restarts == "0"  # no restarts anyway


def test_a_module_runs_as_python_m_runs_it():
    opts = parsed("--standalone", "-m")
    assert worker_command(opts)[:4] == [sys.executable, "-u", "-m", "pretrain_gpt.py"]


def deadpool_launch(*words: str) -> subprocess.CompletedProcess:
    """deadpool-launch with ``words``, from the repository, to its end."""
    from dist_utils import captured

    return captured([sys.executable, "-m", "deadpool_ext.launch", *words], timeout=300)


@pytest.mark.integration
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


@pytest.mark.integration
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
