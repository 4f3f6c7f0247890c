"""deadpool-launch's command line (deadpool_ext/control/command_line.py),
parsed in-process: torchrun's spellings that make sense for a job with warm
spares are taken, the others refused with the reason; a standby, a join and
a spare node held warming that cannot work are refused with what to change.
The jobs deadpool-launch starts are in tests/functional_tests/test_launch.py."""

import pytest

from megatron.training.arguments import ConfigError

from deadpool_ext import protocol as P
from deadpool_ext.control import command_line
from deadpool_ext.control.command_line import build_parser, check, checked_options

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


def test_a_spare_node_held_warming_must_exist(monkeypatch):
    monkeypatch.setenv("DEADPOOL_SECRET", "s")
    flags = ["--nnodes", "2", "--spare-nodes", "1", "--master-port", "1234", *SCRIPT]
    held = ["--deadpool-inject", "slow-warm:node=3:gen=1"]
    with pytest.raises(ConfigError, match="node 3 does not exist"):
        checked_options([*flags, *held])
    checked_options([*flags, "--deadpool-inject", "slow-warm:node=2:gen=1"])


@pytest.mark.parametrize(
    "flags",
    [
        ["--standalone", "--nnodes", "2", "--spare-nodes", "1"],
        ["--nnodes", "1", "--spare-nodes", "1", "--master-port", "1234"],
    ],
    ids=["standalone", "two-nodes"],
)
def test_a_standby_that_cannot_work_is_refused_with_what_to_change(flags, monkeypatch):
    monkeypatch.setenv(P.SECRET_ENV, "x")
    opts = command_line.build_parser().parse_args(
        [*flags, "--standby-addr", "h", "pretrain_gpt.py"]
    )
    with pytest.raises(ConfigError, match="at least 3 nodes in all"):
        command_line.check(opts)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--join", "--standalone", "--node-rank", "1", "x.py"], "not --standalone"),
        (["--join", "--node-rank", "0", "--master-port", "29500", "x.py"], "--node-rank >= 1"),
        (["--join", "--node-rank", "2", "x.py"], "--master-port"),
    ],
)
def test_join_needs_the_running_jobs_address_and_a_node_index(argv, message):
    from deadpool_ext.control.command_line import build_parser, check

    with pytest.raises(ConfigError) as error:
        check(build_parser().parse_args(argv))
    assert message in str(error.value)
