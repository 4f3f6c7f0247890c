"""deadpool-launch (deadpool_ext/control/launch.py), in-process: a store
whose port is taken is a usage error, said in one line, and nothing
outlives it. The jobs deadpool-launch starts are in
tests/functional_tests/test_launch.py."""

import socket

import pytest

from deadpool_ext.control import launch
from deadpool_ext.control.launch import main
from deadpool_ext.control.ports import free_port
from deadpool_ext.protocol import ExitCode
from tests.unit_tests.control.test_command_line import SCRIPT


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
