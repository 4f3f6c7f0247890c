"""deadpool-launch's command line (deadpool_ext/control/command_line.py), parsed
in-process: torchrun's spellings that make sense for a job with warm spares
are taken, the others refused with the reason; ``-m`` runs a module, as
torchrun's. The jobs deadpool-launch starts are in
tests/functional_tests/test_launch.py."""

import socket
import sys

import pytest

from megatron.training.arguments import ConfigError

from deadpool_ext.control import launch
from deadpool_ext.control.command_line import build_parser, check, checked_options
from deadpool_ext.control.launch import main
from deadpool_ext.control.ports import can_bind, ephemeral_ports, free_port
from deadpool_ext.control.process_tree import worker_command
from deadpool_ext.protocol import ExitCode

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


def test_a_free_port_and_the_next_lie_outside_the_ephemeral_ports():
    """No connection made before the job's stores listen can take them."""
    low, high = ephemeral_ports()
    for _ in range(20):
        port = free_port(span=2)
        assert not (low <= port <= high or low <= port + 1 <= high), port
        assert can_bind(port) and can_bind(port + 1)


@pytest.mark.parametrize("node", [0, 1], ids=["store", "standby"])
def test_a_store_whose_port_is_taken_says_what_to_change(node, capsys, monkeypatch):
    """Node 0's store listens on --master-port, node 1's standby store on
    the next: either taken is a usage error, said in one line."""
    monkeypatch.setenv("DEADPOOL_SECRET", "s")
    agent = AgentStandIn()
    monkeypatch.setattr(launch, "start_agents", lambda *_: {0: agent})  # node 0's, first
    port = free_port(span=2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + node))
        taken.listen()
        code = main(
            ["--nnodes", "2", "--spare-nodes", "1", "--nproc-per-node", "1", "--node-rank"]
            + [str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
            + ["--standby-addr", "127.0.0.1", *SCRIPT]
        )
    said = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.USAGE and len(said) == 1, said
    where = f"127.0.0.1:{port + node}"
    assert said[0].startswith("deadpool-launch: error: ") and where in said[0], said
    assert ("standby's store" in said[0]) == (node == 1) and "--master-port" in said[0]
    assert agent.killed == (node == 0)  # nothing outlives a usage error


class AgentStandIn:
    killed = False

    def kill(self):
        self.killed = True


def test_a_spare_node_held_warming_must_exist(monkeypatch):
    monkeypatch.setenv("DEADPOOL_SECRET", "s")
    flags = ["--nnodes", "2", "--spare-nodes", "1", "--master-port", "1234", *SCRIPT]
    held = ["--deadpool-inject", "slow-warm:node=3:gen=1"]
    with pytest.raises(ConfigError, match="node 3 does not exist"):
        checked_options([*flags, *held])
    checked_options([*flags, "--deadpool-inject", "slow-warm:node=2:gen=1"])
