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


def ended_job(heartbeat_timeout: float, beating=(1, 2)):
    """A coordinator whose last look heard ``beating``, and an agent's
    channel on its store."""
    from deadpool_ext.policy.view import Sighting
    from deadpool_ext.wire import Channel
    from tests.unit_tests.control.store_job import (
        SECRET,
        Clock,
        coordinator_on,
        new_store,
        settings,
    )

    store = new_store()
    coordinator = coordinator_on(store, Clock(), settings(heartbeat_timeout=heartbeat_timeout))
    coordinator.detector.last = Sighting(beating=frozenset(beating))
    return coordinator, Channel(store, SECRET)


def test_the_store_stays_up_until_every_beating_agent_read_its_stop():
    """A spare node whose link to node 0 lost packets read its stop after
    node 0's launcher had closed the store: it took the end for the
    coordinator's loss, waited 65 s for a takeover and ended with exit 9.
    The launcher now waits for each agent it heard to say it is stopping."""
    import threading

    from deadpool_ext import protocol as P

    coordinator, agent = ended_job(heartbeat_timeout=60.0)
    said = threading.Timer(0.3, lambda: [agent.put(P.stopping_key(n), time=0) for n in (1, 2)])
    said.start()
    launch.await_stopping(coordinator)
    said.join()
    for node in (1, 2):
        assert coordinator.channel.get(P.stopping_key(node)) is not None


def test_an_agent_that_never_says_it_stops_is_waited_for_one_heartbeat_timeout():
    """The control: a node silent at the end (cut off, dead) holds the end
    back one heartbeat timeout at most, and one never heard not at all."""
    from deadpool_ext import protocol as P

    coordinator, agent = ended_job(heartbeat_timeout=0.5)
    agent.put(P.stopping_key(1), time=0)  # node 2 never says it
    launch.await_stopping(coordinator)
    assert coordinator.channel.get(P.stopping_key(2)) is None
    coordinator.detector.last = type(coordinator.detector.last)()  # nobody heard
    launch.await_stopping(coordinator)


def test_a_rejoined_nodes_old_word_is_not_its_own_and_a_silent_agent_holds_nothing():
    """A node drained and repaired joins again under its index: what its
    predecessor said at the end does not count for the new agent (which
    says it is pending at its start); an agent killed at the end says
    nothing, and counts as done once its beats are a timeout old."""
    from deadpool_ext import protocol as P
    from deadpool_ext.wire import Channel

    coordinator, old_agent = ended_job(heartbeat_timeout=60.0)
    old_agent.put(P.stopping_key(1), time=0)
    new_agent = Channel(old_agent.store, old_agent.secret)
    new_agent.put(P.stopping_key(1), pending=True)
    assert not launch.has_stopped(coordinator, 1)
    new_agent.put(P.stopping_key(1), time=1)
    assert launch.has_stopped(coordinator, 1)
    assert not launch.has_stopped(coordinator, 2)  # beating, not said yet
    silent_since = coordinator.clock() - 61.0
    coordinator.detector.seen[P.node_heartbeat_key(2)] = (None, silent_since)
    assert launch.has_stopped(coordinator, 2)
