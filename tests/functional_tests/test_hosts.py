"""Jobs across emulated hosts (tools/hosts.py): each node's deadpool-launch
in a network namespace of its own, with its own address and hostname, as on
a cluster (no --standalone), so that the store, gloo and the mirror cross a
real (virtual) network; and failures of that network, not of processes.

Three active hosts and a spare host, TP2 x DP3 (three and three with one
rank each for the coordinator's nodes lost in a row): node 0 holds the store
and the coordinator, node 1 the standby. Every recovered run must end as the
failure-free run (on loopback, the same flags) bit for bit. Runs as root
(CI does); skipped with the reason where hosts cannot be made.
"""

import json
import os
import time

import pytest

from dist_utils import (
    assert_same_run,
    deadpool_args,
    launch_deadpool,
    leftovers,
    metrics_reach,
    must_succeed,
    readable_logs,
    start_on_hosts,
    wait_for,
)
from deadpool_ext.defaults import CONTROL_SILENCE_S
from deadpool_ext.events import read_events
from deadpool_ext.protocol import ExitCode
from tools import hosts
from tools.chaos_network import one_writer_per_generation

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(hosts.missing() is not None, reason=str(hosts.missing())),
]

ITERS = 16
NODES, SPARES, PER_NODE = 3, 1, 2
LAYOUT = ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--use-tp-pp-dp-mapping"]
SCHEDULE = ["--global-batch-size", "12", "--train-iters", str(ITERS)]


@pytest.fixture(scope="module")
def corpus(corpus_prefix):
    os.environ["HOT_SWAP_CORPUS"] = corpus_prefix
    return corpus_prefix


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    """The failure-free run, on loopback through --standalone."""
    tmp = tmp_path_factory.mktemp("reference")
    must_succeed(launch_deadpool(tmp, LAYOUT, NODES, 0, PER_NODE, [], ITERS, schedule=SCHEDULE))
    return tmp


def args(tmp, faults=()):
    return deadpool_args(tmp, LAYOUT, list(faults), ITERS, schedule=SCHEDULE)


def events_of(tmp):
    return read_events(str(tmp / "events.jsonl"))


def isolated_until_recovered(tmp_path, host: int, gray=None, cut=None):
    """The job across the hosts; ``host`` isolated at the switch (or ``cut``
    done to the lab) once iteration 4 is logged, healed once the job
    recovered. ``gray``: host ->
    percent of packets it loses from iteration 2, and host -> seconds its
    link flaps once the job recovered. The launchers' exit codes, and when
    (time.time()) the host was cut off."""
    lose, flap = gray or ({}, {})
    with hosts.Lab(NODES + SPARES) as lab:
        launchers = start_on_hosts(lab, tmp_path, args(tmp_path), NODES, SPARES, PER_NODE)
        metrics = tmp_path / "metrics.jsonl"
        assert hosts.wait_until(lambda: metrics_reach(metrics, 2), 300), readable_logs(tmp_path, 4)
        for other, percent in lose.items():
            lab.lose(other, percent)
        assert hosts.wait_until(lambda: metrics_reach(metrics, 4), 300), readable_logs(tmp_path, 4)
        cut_at = time.time()
        (cut or (lambda lab: lab.isolate(host)))(lab)
        recovered = lambda: any(e["event"] == "recovered" for e in events_of(tmp_path))  # noqa: E731
        assert hosts.wait_until(recovered, 240), readable_logs(tmp_path, 4)
        lab.heal(host)
        for other, seconds in flap.items():
            lab.flap(other, seconds)
        return wait_for(launchers), cut_at


def test_an_isolated_host_is_swapped_and_once_healed_is_fenced(tmp_path, reference):
    """Host 2's network goes (every packet dropped at the switch) in the
    run's fifth iteration: its node is declared lost after the heartbeat
    timeout, the spare host takes its ranks from their buddies. Healed once
    the job trains again, node 2 learns it was declared lost and leaves:
    nothing it says is taken, and the curve is the failure-free one. Gray
    faults beside it cost only time: host 1 loses 2% of its packets (both
    ways) from iteration 2 on, and the spare host's link, its ranks members
    now, goes for 1 s after the recovery (TCP's resends back off while it is
    cut, so the connections stall up to 1.4 s: under half the heartbeat
    timeout); TCP carries the store's, gloo's and the mirror's traffic
    through both, and neither is declared lost. A claimed inbox slot
    written late over the lossy link holds back the ranks' Done messages
    behind it, and node 0's agent may end first: node 0 is no loss."""
    codes, _ = isolated_until_recovered(tmp_path, 2, gray=({1: 2}, {3: 1.0}))
    logs = readable_logs(tmp_path, NODES + SPARES)
    assert codes == [0, 0, ExitCode.FENCED, 0], logs
    assert "declared this node lost" in (tmp_path / "node2.log").read_text()
    assert_same_run(tmp_path, reference, ITERS)
    events = events_of(tmp_path)
    detected = [e for e in events if e["event"] == "failure_detected"]
    assert len(detected) == 1 and detected[0]["ranks"] == [4, 5], logs
    decided = [e for e in events if e["event"] == "decision"]
    assert decided[-1]["replaced"] == {"4": "3.0", "5": "3.1"}
    assert not leftovers(tmp_path)


def test_a_host_cut_off_from_its_peers_but_not_from_the_stores_is_swapped_and_fenced(
    tmp_path, reference
):
    """Host 2's connections to every other host are dropped in the fifth
    iteration, but the control plane's (the coordinator's store, the
    standby's): its heartbeats arrive, so no heartbeat rule sees it, and its
    peers wait in a collective that would last until gloo's timeout. Their
    kernels see data sent to host 2 left unacknowledged, and so do host 2's:
    after the heartbeat timeout the coordinator declares node 2 lost (its
    peers cannot reach it) and the spare host takes its ranks from their
    buddies; node 2 is fenced, the curve is the failure-free one."""
    stores = (29500, 29501)
    codes, _ = isolated_until_recovered(tmp_path, 2, cut=lambda lab: lab.cut_data(2, stores))
    logs = readable_logs(tmp_path, NODES + SPARES)
    assert codes == [0, 0, ExitCode.FENCED, 0], logs
    assert_same_run(tmp_path, reference, ITERS)
    detected = [e for e in events_of(tmp_path) if e["event"] == "failure_detected"]
    assert len(detected) == 1 and detected[0]["ranks"] == [4, 5], logs
    assert "unreachable from node(s)" in detected[0]["reason"], detected[0]
    assert not leftovers(tmp_path)


def test_node_0_cut_off_from_every_host_the_standby_takes_over_and_node_0_is_fenced(
    tmp_path, reference
):
    """The partition that leaves node 0 (the store and the coordinator) alone
    and every other host on the majority side: node 0's coordinator stops
    deciding (it hears no majority), the standby on node 1 takes over once
    the agents came over, node 0's ranks come back from their buddies on the
    spare host. Healed, node 0 learns it was declared lost and leaves; the
    curve is the failure-free one. The other hosts' lines to node 0 are cut
    off after the heartbeat timeout (3 s), so the takeover comes well before
    CONTROL_SILENCE_S (30 s), a request's bound, would have let it."""
    codes, cut_at = isolated_until_recovered(tmp_path, 0)
    logs = readable_logs(tmp_path, NODES + SPARES)
    assert codes == [ExitCode.FENCED, 0, 0, 0], logs
    assert_same_run(tmp_path, reference, ITERS)
    events = events_of(tmp_path)
    assert one_writer_per_generation(events)
    said = [(e["event"], e["term"]) for e in events if e["rank"] == -1]
    assert ("majority_lost", 0) in said and ("fenced", 0) in said, said
    assert ("takeover", 1) in said and ("decision", 1) in said, said
    assert not [e for e in said if e[1] == 0 and e[0] in ("failure_detected", "decision")], said
    fenced = next(e for e in events if e["event"] == "fenced")
    assert "standby took over" in fenced["reason"]
    takeover = next(e for e in events if e["event"] == "takeover")
    assert takeover["time"] - cut_at < CONTROL_SILENCE_S / 2, takeover["time"] - cut_at


# One rank per host: node 0, then 1, then 2 lost, each swapped from a spare host.
CHAIN = ["--num-layers", "2", "--use-tp-pp-dp-mapping"]


@pytest.fixture(scope="module")
def chain_reference(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("chain-reference")
    must_succeed(launch_deadpool(tmp, CHAIN, NODES, 0, 1, [], ITERS, schedule=SCHEDULE))
    return tmp


def test_node_0_then_node_1_then_node_2_are_lost_and_the_job_finishes_bit_for_bit(
    tmp_path, chain_reference
):
    """Every coordinator in turn dies with its host, each once the last
    recovery ended: node 0 (the store and the coordinator) in iteration 4,
    then node 1, whose standby took over, in iteration 8, then node 2 in
    iteration 12. After each takeover the new coordinator appoints the next
    standby (the lowest live node serving a store), so each loss is survived
    as the first: a spare host takes the lost rank from its buddy, and the
    curve is the failure-free one."""
    faults = ["kill:node=0:iter=4", "kill:node=1:iter=8", "kill:node=2:iter=12"]
    args = deadpool_args(tmp_path, CHAIN, faults, ITERS, schedule=SCHEDULE)
    with hosts.Lab(2 * NODES) as lab:
        codes = wait_for(start_on_hosts(lab, tmp_path, args, NODES, NODES, 1))
    assert codes == [-9, -9, -9, 0, 0, 0], readable_logs(tmp_path, 2 * NODES)
    assert_same_run(tmp_path, chain_reference, ITERS)
    events = events_of(tmp_path)
    assert one_writer_per_generation(events)
    said = [e for e in events if e["rank"] == -1]
    takeovers = [(e["term"], e["node"]) for e in said if e["event"] == "takeover"]
    assert takeovers == [(1, 0), (2, 1), (3, 2)], takeovers
    appointed = [(e["term"], e["node"]) for e in said if e["event"] == "standby_appointed"]
    assert appointed == [(0, 1), (1, 2), (2, 3), (3, 4)], appointed
    assert not [e for e in said if e["event"] == "abort"]


def test_a_seeded_trial_of_the_network_campaign_ends_as_the_design_says(tmp_path):
    """tools/chaos.py --target network, trial 24 of seed 1 (TP1 x PP4 x DP2
    on two 4-rank hosts and a spare host): host 0's link goes down (the
    store and the coordinator; loudly, where the test above cuts it
    silently) in iteration 4. The other hosts' lines to it are cut off, the
    standby takes over, node 0 is declared lost and swapped, and healed it
    leaves; one coordinator per generation; the curve and every rank's final
    state are the failure-free run's. (The whole campaign draws every fault
    kind: docs/reliability.md.)"""
    from tools import chaos

    argv = ["--target", "network", "--seed", "1", "--only", "24", "--workdir", str(tmp_path)]
    output = tmp_path / "results.json"
    assert chaos.main(argv + ["--output", str(output)]) == 0
    (result,) = json.loads(output.read_text())["results"]
    assert result["draw"].endswith("isolate-loud host 0 iter=4") and result["expected"] == "swap"


PROBE = """
import socket, sys
try:
    print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1.5).recv(2).decode())
except OSError as error:
    print(type(error).__name__)
"""
SERVER = """
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5555))
s.listen()
while True:
    c, _ = s.accept()
    c.sendall(b"hi")
    c.close()
"""


def test_the_labs_faults_cut_what_they_say_and_heal():
    """Each verb of tools/hosts.py, seen by a TCP client of host 0's server."""
    import subprocess
    import sys
    import time

    def reach(lab, host, port=5555):
        argv = [sys.executable, "-c", PROBE, lab.hosts[0].address, str(port)]
        return subprocess.run(
            lab.command(host, argv), capture_output=True, text=True
        ).stdout.strip()

    with hosts.Lab(3) as lab:
        lab.start(0, [sys.executable, "-c", SERVER])
        assert hosts.wait_until(lambda: reach(lab, 1) == "hi", 10)
        lab.isolate(2)
        assert (reach(lab, 1), reach(lab, 2)) == ("hi", "TimeoutError")
        lab.heal(2)
        lab.cut(1, 0, one_way=True)
        assert (reach(lab, 1), reach(lab, 2)) == ("TimeoutError", "hi")
        lab.heal(0)  # a cut is healed from either end
        lab.cut(1, 0, port=5555)
        assert (reach(lab, 1), reach(lab, 1, port=5556)) == (
            "TimeoutError",
            "ConnectionRefusedError",
        )
        lab.heal(1)
        lab.cut_data(1, keep_ports=[5555])
        assert (reach(lab, 1), reach(lab, 1, port=5556)) == ("hi", "TimeoutError")
        lab.heal(0)
        lab.lose(1, 100)
        assert reach(lab, 1) == "TimeoutError"
        lab.heal(1)
        assert hosts.wait_until(lambda: reach(lab, 1) == "hi", 10)
        lab.isolate(1, loud=True)
        assert reach(lab, 1) != "hi"
        lab.heal(1)
        lab.slow(1, 1)
        assert reach(lab, 1) == "hi"
        lab.heal(1)
        lab.flap(2, 4.0)  # longer than a probe takes to give up
        assert reach(lab, 2) == "TimeoutError"
        time.sleep(3.0)
        assert hosts.wait_until(lambda: reach(lab, 2) == "hi", 10)
        prefix = lab.prefix
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in left
