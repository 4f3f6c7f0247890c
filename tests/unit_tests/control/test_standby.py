"""The standby coordinator, driven by hand on real stores with a fake clock:
the primary's state reaches the standby before anything it publishes, the
standby takes over only when the primary's lease is silent and a majority
of nodes came over, and the coordinator it builds goes on from the state."""

import pytest
import torch.distributed as dist

from deadpool_ext import protocol as P
from deadpool_ext.control import run_loop
from deadpool_ext.control.record import JobRecord
from deadpool_ext.control.standby import Standby, Verdict
from deadpool_ext.defaults import TAKEOVER_GRACE_S, TAKEOVER_WAIT_S
from deadpool_ext.protocol import Decision, ExitCode
from deadpool_ext.wire import Channel, JobEnded, standby_channel
from tests.unit_tests.control import store_job
from tests.unit_tests.control.store_job import BUDDY, SECRET, Clock, new_store, start


def coordinator_on(store, clock, record=None, standbys=None):
    """The job of tests/unit_tests/control/store_job.py, shrinking when spares run out."""
    shrink = store_job.settings("shrink")
    return store_job.coordinator_on(store, clock, shrink, record=record, standbys=standbys)


def report(worker, gen, ranks, own=(5, 4)):
    store_job.reports(worker, gen, ranks, own, held=[4])


class StandbyStores:
    """Stores that the nodes' launchers serve for a standby, by address."""

    def __init__(self):
        self.stores = {}

    def serve(self, node: int, worker: Channel):
        """Node ``node``'s launcher serves one, and its agent says so."""
        store = new_store()
        address = f"127.0.0.1:{store.port}"
        self.stores[address] = store
        up = P.NodeUp(node=node, active=node < 2, nproc=2, world_size=4, standby_store=address)
        worker.post(P.COORDINATOR_TOPIC, up)
        return Channel(store, SECRET)

    def open(self, address: str) -> Channel:
        return Channel(self.stores[address], SECRET)


@pytest.fixture()
def stores():
    return StandbyStores()


@pytest.fixture()
def primary(stores):
    """A primary coordinator that replicates to node 1's standby store."""
    clock, store = Clock(), new_store()
    coordinator = coordinator_on(store, clock, standbys=stores.open)
    worker = Channel(store, SECRET)
    standby = stores.serve(1, worker)
    start(worker, coordinator)
    return coordinator, worker, standby, clock


def replicated(standby: Channel) -> JobRecord:
    return JobRecord.from_json(standby.get(P.STATE_KEY)["state"])


def test_the_standby_holds_every_generation_and_decision_the_workers_can_see(primary):
    coordinator, worker, standby, _ = primary
    worker.post("coordinator", kind="exit", slot="1.1", code=-9)
    coordinator.step()
    assert worker.get("gen")["gen"] == replicated(standby).gen == 1
    report(worker, 1, [0, 1, 2])
    coordinator.step()
    decision = worker.get("decision/1")
    record = replicated(standby)
    assert record.decision.to_message() == decision and record.state == "rebuilding"
    assert record.membership.members == {0: "0.0", 1: "0.1", 2: "1.0", 3: "2.0"}
    assert record.membership.spares == ["2.1"] and record.membership.lost_slots == {"1.1"}
    assert record.plan.buddy == BUDDY


class GoneStandby:
    def put(self, *args, **kwargs):
        raise dist.DistError("connection reset by peer")


def test_once_the_standby_cannot_be_written_every_process_hears_there_is_none(primary):
    """Its copy falls behind from then on: a process that turned to it after
    node 0's loss would find a stale state, so none may (agents and workers
    fail over only while the generation says ``standby``)."""
    coordinator, worker, standby, _ = primary
    assert worker.get("gen")["standby"] == f"127.0.0.1:{standby.store.port}"
    coordinator.replica.channel = GoneStandby()
    worker.post("coordinator", kind="exit", slot="1.1", code=-9)
    coordinator.step()
    assert coordinator.record.standby_node is None and worker.get("gen")["standby"] is None
    assert worker.get("gen")["gen"] == 1


def test_a_standby_takes_over_only_when_the_lease_is_silent_and_a_majority_came(primary):
    coordinator, worker, standby_channel, clock = primary
    standby = Standby(standby_channel, node=1, heartbeat_timeout=3.0, wait_s=20.0, clock=clock)
    for _ in range(5):  # the primary beats
        clock.now += 1.0
        coordinator.step()
        assert standby.poll() == Verdict.WAIT
    clock.now += 3.5  # the primary fell silent; only the standby's own node is here
    assert standby.poll() == Verdict.WAIT
    standby_channel.post(P.STANDBY_TOPIC, P.LostPrimary(node=2))
    assert standby.poll() == Verdict.TAKE_OVER
    assert standby.came_over == {1, 2} and standby.record.gen == 0


def test_a_lease_that_beats_again_after_a_lapse_stops_the_takeover(primary):
    """Votes stand for good, and the standby counts its own node whatever its
    agent does: only a lease silent now keeps a takeover from a primary that
    hears a majority again (a voter never goes back to it, but the
    standby's own node's agent may not have lost it at all)."""
    coordinator, _, standby_channel, clock = primary
    standby = Standby(standby_channel, node=1, heartbeat_timeout=3.0, wait_s=20.0, clock=clock)
    coordinator.step()
    assert standby.poll() == Verdict.WAIT
    clock.now += 3.5  # silent for more than the timeout, and a majority came over
    standby_channel.post(P.STANDBY_TOPIC, P.LostPrimary(node=2))
    coordinator.step()  # but the primary's lease beats again first
    assert standby.poll() == Verdict.WAIT
    clock.now += 3.5
    assert standby.poll() == Verdict.TAKE_OVER  # silent again: the votes take over


def test_votes_while_the_lease_beats_take_nothing(primary):
    coordinator, _, standby_channel, clock = primary
    standby = Standby(standby_channel, node=1, heartbeat_timeout=3.0, wait_s=20.0, clock=clock)
    standby_channel.post(P.STANDBY_TOPIC, P.LostPrimary(node=2))
    for _ in range(6):
        clock.now += 1.0
        coordinator.step()
        assert standby.poll() == Verdict.WAIT
    assert standby.came_over == {1, 2}


def test_without_a_majority_the_standby_gives_up_after_its_wait(primary):
    coordinator, _, standby_channel, clock = primary
    standby = Standby(standby_channel, node=1, heartbeat_timeout=3.0, wait_s=20.0, clock=clock)
    coordinator.step()
    standby.poll()
    clock.now += 3.0 + 19.0
    assert standby.poll() == Verdict.WAIT
    clock.now += 2.0
    assert standby.poll() == Verdict.GIVE_UP


def test_a_finished_job_is_not_taken_over(primary):
    coordinator, worker, standby_channel_, clock = primary
    standby = Standby(standby_channel_, node=1, heartbeat_timeout=3.0, clock=clock)
    for rank in range(4):
        worker.post("coordinator", kind="done", rank=rank, slot=f"{rank // 2}.{rank % 2}")
    coordinator.step()
    standby.poll()
    standby_channel_.post(P.STANDBY_TOPIC, P.LostPrimary(node=2))
    clock.now += 4.0
    assert standby.poll() == Verdict.GIVE_UP
    # Whoever loses the primary now stops instead of waiting for a takeover.
    with pytest.raises(JobEnded, match="the job ended in generation 0"):
        standby_channel(("127.0.0.1", standby_channel_.store.port), SECRET, timeout_s=30)


def test_the_coordinator_that_takes_over_loses_node_0_and_swaps_it_from_spares(primary):
    coordinator, worker, standby_channel, clock = primary
    clock.now += 1.0
    coordinator.step()  # training; then node 0 dies with the primary
    successor = coordinator_on(standby_channel.store, clock, record=replicated(standby_channel))
    successor.take_over(1, "the coordinator's node went silent")
    client = Channel(standby_channel.store, SECRET)
    assert client.get("gen")["gen"] == 1 and client.get("gen")["lost"] == [0, 1]
    assert client.get("gen")["assign"] == {"0": "2.0", "1": "2.1"}
    assert [c["kind"] for c in client.reader(P.agent_topic(0)).poll()] == ["kill_all"]
    report(client, 1, [2, 3])
    successor.step()
    # No agent has beaten here yet, so no spare is known to be warming: a
    # decision now would shrink. It waits until the live nodes beat.
    assert client.get("decision/1") is None
    for node in (1, 2):
        client.put(P.node_heartbeat_key(node), time=clock.now)
    successor.step()
    decision = Decision.from_message(client.get("decision/1"))
    assert decision.action == "recover" and decision.replaced == {0: "2.0", 1: "2.1"}
    assert decision.from_buddy == [0, 1] and decision.rollback_to == 4


def test_the_successor_expects_every_live_node_to_beat_on_its_store(primary):
    """A node whose agent never came over (it died with node 0) is silent
    there: declared lost once the grace for coming over and the timeout
    have passed, like any silent node; not before (it may have noticed
    late that node 0 is gone)."""
    coordinator, _, standby_channel, clock = primary
    successor = coordinator_on(standby_channel.store, clock, record=replicated(standby_channel))
    successor.take_over(1, "silent")
    beating = Channel(standby_channel.store, SECRET)

    def beat_for(seconds):
        for _ in range(int(seconds)):
            clock.now += 1.0
            beating.put(P.node_heartbeat_key(1), time=clock.now)
            for slot in ("1.0", "1.1"):
                beating.put(P.worker_heartbeat_key(slot), state="recovering")
            successor.step()

    beat_for(TAKEOVER_GRACE_S + 2.0)
    assert sorted(successor.record.membership.lost_slots) == ["0.0", "0.1"]
    beat_for(2.0)
    assert sorted(successor.record.membership.lost_slots) == ["0.0", "0.1", "2.0", "2.1"]


def silence_nodes_1_and_2(coordinator, worker, clock):
    """Every node beats, then node 0 alone for longer than the timeout; node
    0's ranks report the generation that follows."""
    for node in (0, 1, 2):
        worker.put(P.node_heartbeat_key(node), time=0)
    coordinator.step()
    clock.now += 4.0
    worker.put(P.node_heartbeat_key(0), time=1)
    coordinator.step()
    report(worker, coordinator.gen, [0, 1])
    coordinator.step()


def test_a_primary_that_hears_no_majority_declares_nobody_lost_and_decides_nothing(primary):
    """Nodes 1 and 2 silent at once (a partition): the other side may be the
    majority and take over, so this side neither declares them lost nor
    decides (it would shrink to node 0); heard again before anyone came over,
    it goes on where it was."""
    coordinator, worker, _, clock = primary
    state = coordinator.state
    silence_nodes_1_and_2(coordinator, worker, clock)
    assert coordinator.gen == 0 and coordinator.record.lost == set()
    assert coordinator.record.membership.lost_slots == set()
    assert coordinator.record.result is None and coordinator.watch.cut_off_at is not None
    assert worker.get("decision/1") is None and worker.get("gen")["gen"] == 0
    for node in (0, 1, 2):
        worker.put(P.node_heartbeat_key(node), time=2)
    coordinator.step()
    assert coordinator.watch.cut_off_at is None and coordinator.gen == 0
    assert coordinator.state == state


def test_across_a_partition_the_first_timeout_is_not_a_loss(primary):
    """Cut off, the primary sees the other nodes' timeouts run out one after
    another (their last beats came at different times): when node 1's runs
    out, node 2's last beat is 2.5 s old, within its 3 s but not heard
    lately. No node is declared lost: it is cut off. (Counting node 2 as
    heard, it declared node 1 lost and opened a generation the standby
    decided too: tests/functional_tests/test_hosts.py saw it.)"""
    coordinator, worker, _, clock = primary
    for node in (0, 1, 2):
        worker.put(P.node_heartbeat_key(node), time=0)
    coordinator.step()
    clock.now += 1.0
    for node in (0, 2):
        worker.put(P.node_heartbeat_key(node), time=1)
    coordinator.step()
    clock.now += 2.5  # node 1 silent 3.5 s, node 2 2.5 s
    worker.put(P.node_heartbeat_key(0), time=2)
    coordinator.step()
    assert coordinator.record.membership.lost_slots == set() and coordinator.gen == 0
    assert coordinator.watch.cut_off_at is not None


def test_one_silent_node_among_nodes_heard_lately_is_lost(primary):
    """The control: node 2 beats on, node 1 alone falls silent."""
    coordinator, worker, _, clock = primary
    for second in range(5):
        for node in (0, 2) if second else (0, 1, 2):
            worker.put(P.node_heartbeat_key(node), time=second)
        coordinator.step()
        clock.now += 1.0
    assert coordinator.record.membership.lost_slots == {"1.0", "1.1"}
    assert coordinator.watch.cut_off_at is None


def test_a_healed_partitions_beats_come_back_one_by_one_and_none_is_a_loss(primary):
    """Cut off, then healed: node 2 is heard again first, which makes a
    majority; node 1's beat comes a moment later. Node 1, silent for more
    than the timeout by then, is not declared lost: once a majority is heard
    again, whoever is not yet gets a whole timeout. (Before, it was declared
    lost: tools/chaos.py --target network, seed 1, trial 26.)"""
    coordinator, worker, _, clock = primary
    silence_nodes_1_and_2(coordinator, worker, clock)
    assert coordinator.watch.cut_off_at is not None
    clock.now += 4.0
    for node in (0, 2):
        worker.put(P.node_heartbeat_key(node), time=5)
    coordinator.step()
    assert coordinator.watch.cut_off_at is None
    clock.now += 1.0
    for node in (0, 1, 2):
        worker.put(P.node_heartbeat_key(node), time=6)
    coordinator.step()
    assert coordinator.record.membership.lost_slots == set() and coordinator.gen == 0


def test_a_node_still_silent_a_timeout_after_the_heal_is_lost(primary):
    """The control: node 1 stays silent after node 2 was heard again."""
    coordinator, worker, _, clock = primary
    silence_nodes_1_and_2(coordinator, worker, clock)
    for second in range(5):
        clock.now += 1.0
        for node in (0, 2):
            worker.put(P.node_heartbeat_key(node), time=10 + second)
        coordinator.step()
    assert coordinator.record.membership.lost_slots == {"1.0", "1.1"}


def test_a_cut_off_primary_leaves_once_the_standby_took_over(primary):
    coordinator, worker, _, clock = primary
    commands = worker.reader(P.agent_topic(0))
    silence_nodes_1_and_2(coordinator, worker, clock)
    coordinator.superseded()
    assert "standby took over" in coordinator.watch.fenced
    assert {"kind": "kill_all", "slot": None} in commands.poll()
    assert run_loop.run(coordinator, poll_s=0.0) == ExitCode.FENCED
    assert worker.get("decision/1") is None


def test_a_cut_off_primary_leaves_once_the_standby_would_have_given_up(primary):
    """Still cut off after the heartbeat timeout and the standby's wait for
    a majority: whichever side goes on, this one cannot."""
    coordinator, worker, _, clock = primary
    silence_nodes_1_and_2(coordinator, worker, clock)
    clock.now += TAKEOVER_WAIT_S
    worker.put(P.node_heartbeat_key(0), time=3)
    coordinator.step()
    assert coordinator.watch.fenced is None
    clock.now += 4.0
    worker.put(P.node_heartbeat_key(0), time=4)
    coordinator.step()
    assert "cut off from the majority" in coordinator.watch.fenced
    assert worker.get("decision/1") is None and coordinator.gen == 0


def test_without_a_standby_the_same_losses_shrink_the_job():
    """The control: no standby, no quorum rule."""
    clock = Clock()
    coordinator = coordinator_on(new_store(), clock)
    worker = Channel(coordinator.channel.store, SECRET)
    start(worker, coordinator)
    silence_nodes_1_and_2(coordinator, worker, clock)
    assert coordinator.record.result is None and coordinator.state == "resizing"


def test_when_only_the_coordinators_launcher_died_training_goes_on(primary):
    """Node 0's agent came over: its ranks live. In training the successor
    keeps the generation (no rank redoes anything); in the middle of a
    recovery, whose reports went to the primary, everyone reports again."""
    coordinator, worker, standby_channel, clock = primary
    clock.now += 1.0
    coordinator.step()
    successor = coordinator_on(standby_channel.store, clock, record=replicated(standby_channel))
    successor.take_over(1, "silent", node_alive=True)
    client = Channel(standby_channel.store, SECRET)
    assert client.get("gen")["gen"] == 0 and successor.record.lost == set()
    assert successor.record.membership.lost_slots == set()

    worker.post("coordinator", kind="exit", slot="1.1", code=-9)
    coordinator.step()  # recovering generation 1; then the launcher dies
    successor = coordinator_on(standby_channel.store, clock, record=replicated(standby_channel))
    successor.take_over(1, "silent", node_alive=True)
    assert client.get("gen")["gen"] == 2 and client.get("gen")["lost"] == [3]
    assert successor.state == "recovering" and successor.record.membership.lost_slots == {"1.1"}


def test_after_a_takeover_the_successor_appoints_the_next_standby(primary, stores):
    """Node 0 lost, node 1 coordinates: node 2's store (its launcher serves
    one too) gets the copy, and every process hears that it is the standby
    now, so that node 1's loss later is survived as node 0's was."""
    coordinator, worker, standby, clock = primary
    node_2 = stores.serve(2, worker)
    clock.now += 1.0
    coordinator.step()  # node 1 holds the copy: nothing moves
    assert coordinator.record.standby_node == 1 and node_2.get(P.STATE_KEY) is None
    successor = coordinator_on(
        standby.store, clock, record=replicated(standby), standbys=stores.open
    )
    successor.take_over(1, "the coordinator's node went silent")
    client = Channel(standby.store, SECRET)
    assert client.get("gen")["standby"] == f"127.0.0.1:{node_2.store.port}"
    copy = replicated(node_2)
    assert copy.coordinator_node == 1 and copy.standby_node == 2 and copy.term == 1
    assert node_2.get(P.LEASE_KEY) is not None


def test_a_standby_whose_node_is_lost_is_replaced(primary, stores):
    coordinator, worker, standby, clock = primary
    node_2 = stores.serve(2, worker)
    worker.post("coordinator", kind="exit", slot="1.0", code=-9)
    worker.post("coordinator", kind="exit", slot="1.1", code=-9)
    coordinator.step()
    assert 1 not in coordinator.view().alive_nodes
    assert coordinator.record.standby_node == 2
    assert worker.get("gen")["standby"] == f"127.0.0.1:{node_2.store.port}"
    assert replicated(node_2).gen == coordinator.gen


def test_with_no_other_store_there_is_no_standby_and_every_process_hears_it(primary):
    """The control of the two above: nobody to appoint."""
    coordinator, worker, _, _ = primary
    worker.post("coordinator", kind="exit", slot="1.0", code=-9)
    worker.post("coordinator", kind="exit", slot="1.1", code=-9)
    coordinator.step()
    assert coordinator.record.standby_node is None and worker.get("gen")["standby"] is None
