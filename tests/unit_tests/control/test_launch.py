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


def test_a_node_sharing_node_1s_host_leaves_node_1_its_standby_port(monkeypatch):
    """Launchers of one host start in any order: node 2's must not take the
    port node 1 listens on (--master-port + 1), which would refuse node 1."""
    import types

    from deadpool_ext.control import launch

    taken = []
    monkeypatch.setattr(launch, "served_store", lambda host, port, *_: taken.append(port))
    monkeypatch.setattr(launch, "free_port", lambda: 40001)
    local = "127.0.0.1"
    opts = types.SimpleNamespace(
        node_rank=2, join=False, master_addr=local, master_port=30000, standby_addr=local
    )
    assert launch.standby_store(opts)[:2] == ("127.0.0.1", 40001)
    opts.node_rank = 1
    assert launch.standby_store(opts)[:2] == ("127.0.0.1", 30001)
    assert taken == [40001, 30001]
