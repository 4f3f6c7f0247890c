"""The control plane's wire (deadpool_ext/wire.py) admits only holders of
the job's secret, and never unpickles: a real TCPStore in this process. A
store whose host goes silent (other processes, in a network namespace) is
in tests/functional_tests/test_wire.py."""

import json
import threading

import pytest

from deadpool_ext.protocol import ENDED_KEY, GEN_KEY, STANDBY_TOPIC, LostPrimary
from deadpool_ext.wire import Channel, JobEnded, connect, next_coordinator
from deadpool_ext.control.ports import free_port


@pytest.fixture(scope="module")
def store():
    port = free_port()
    return connect("127.0.0.1", port, timeout_s=10, is_master=True)


def listening_addresses(port: int) -> set:
    """The local addresses (hex, as /proc/net shows them) listening on ``port``."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def test_the_store_listens_only_where_it_was_asked():
    """--standalone's store on loopback alone (torch's TCPStore would listen
    on every interface: ../shared/reliability-probes/bind_check.py)."""
    port = free_port()
    server = connect("127.0.0.1", port, timeout_s=10, is_master=True)
    assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1
    assert server.num_keys() >= 0
    import datetime

    import torch.distributed as dist

    control = free_port()  # torch's own: every interface
    torch_server = dist.TCPStore(
        "127.0.0.1",
        control,
        is_master=True,
        wait_for_workers=False,
        use_libuv=True,
        timeout=datetime.timedelta(seconds=10),
    )
    assert listening_addresses(control) - {"0100007F"} and torch_server.num_keys() >= 0


def test_messages_round_trip_in_order(store):
    a, b = Channel(store, b"job-secret"), Channel(store, b"job-secret")
    reader = b.reader("t1")
    a.post("t1", kind="exit", slot="1.0", code=-9)
    a.post("t1", kind="spare_ready", slot="2.0")
    assert [m["kind"] for m in reader.poll()] == ["exit", "spare_ready"]
    assert reader.poll() == []
    a.put("gen", gen=3, state="recovering")
    assert b.get("gen") == {"gen": 3, "state": "recovering"}


def test_a_process_without_the_secret_cannot_announce_or_register(store):
    ours, intruder = Channel(store, b"job-secret"), Channel(store, b"guessed")
    reader = ours.reader("t2")
    intruder.post("t2", kind="exit", slot="0.0", code=-9)  # a fake failure
    intruder.post("t2", kind="spare_ready", slot="9.9")  # a fake spare
    intruder.put("decision/1", action="recover", replaced={"0": "9.9"})
    assert reader.poll() == []
    assert ours.get("decision/1") is None
    assert ours.rejected == 3


def test_replayed_or_tampered_messages_are_rejected(store):
    ours = Channel(store, b"job-secret")
    ours.post("t3", kind="exit", slot="0.0", code=-9)
    raw = store.get("topic/t3/1")
    # Replay a genuine message into the next slot of the topic.
    store.add("topic/t3/n", 1)
    store.set("topic/t3/2", raw)
    outer = json.loads(raw)
    outer["body"] = outer["body"].replace("0.0", "0.1")
    store.add("topic/t3/n", 1)
    store.set("topic/t3/3", json.dumps(outer).encode())
    store.add("topic/t3/n", 1)
    store.set("topic/t3/4", b"\x80\x04\x95 not json, and never unpickled")
    got = ours.reader("t3").poll()
    assert got == [{"kind": "exit", "slot": "0.0", "code": -9}]
    assert ours.rejected == 3


def test_a_key_gives_its_newest_authentic_value_whatever_is_replayed_over_it(store):
    """A value older than one a reader has seen (the same writer's earlier
    put, or a writer the key has had since) is not taken: the newest stays
    the answer and its version does not move; garbage neither."""
    writer, reader = Channel(store, b"job-secret"), Channel(store, b"job-secret")
    writer.put("k", n=1)
    first = store.get("key/k")
    writer.put("k", n=2)
    assert reader.get("k") == {"n": 2} and reader.version("k") == (writer.sender, 2)
    store.set("key/k", first)  # a replay
    assert reader.get("k") == {"n": 2} and reader.version("k") == (writer.sender, 2)
    assert reader.replayed == 2  # each of the two reads met the replay
    store.set("key/k", b"garbage")
    assert reader.get("k") == {"n": 2} and (reader.replayed, reader.rejected) == (2, 1)
    successor = Channel(store, b"job-secret")  # a new process writes the key now
    successor.put("k", n=1)
    assert reader.get("k") == {"n": 1} and reader.version("k") == (successor.sender, 1)
    store.set("key/k", first)  # the old writer's value: retired
    assert reader.get("k") == {"n": 1} and reader.replayed == 3


def test_a_claimed_slot_never_written_is_passed_over_after_the_deadline(store):
    """An outsider's claim (or a poster killed between claiming and writing)
    held every later message back for good
    (../shared/reliability-probes/inbox_wedge.py)."""
    from deadpool_ext.defaults import CLAIMED_SLOT_DEADLINE_S

    now = [0.0]
    ours = Channel(store, b"job-secret")
    reader = ours.reader("t5")
    reader.clock = lambda: now[0]
    ours.post("t5", kind="exit", slot="1.0", code=-9)
    assert [m["slot"] for m in reader.poll()] == ["1.0"]
    store.add("topic/t5/n", 1)  # claimed, never written
    ours.post("t5", kind="exit", slot="1.1", code=-9)
    assert reader.poll() == []  # the poster may still be writing it
    now[0] += CLAIMED_SLOT_DEADLINE_S / 2
    assert reader.poll() == []
    now[0] += CLAIMED_SLOT_DEADLINE_S
    assert [m["slot"] for m in reader.poll()] == ["1.1"] and reader.skipped == 1


def test_a_poisoned_topic_counter_is_mended_and_every_message_still_arrives():
    """An outsider overwrites a topic's counter with a non-number: the store's
    server drops every client that adds to it. The reader and the posters
    connect again, set the counter to the highest written slot, and go on
    (../shared/reliability-probes/counter_poison.py)."""
    port = free_port()
    server = connect("127.0.0.1", port, timeout_s=10, is_master=True)
    address = ("127.0.0.1", port)
    coordinator = Channel(server, b"job-secret", address=address)
    inbox = coordinator.reader("t6")
    agent = Channel(connect(*address, timeout_s=10), b"job-secret", address=address)
    attacker = connect(*address, timeout_s=10)
    agent.post("t6", kind="exit", slot="1.0", code=-9)
    assert [m["slot"] for m in inbox.poll()] == ["1.0"]
    attacker.set("topic/t6/n", b"not-a-number")
    agent.post("t6", kind="exit", slot="1.1", code=-9)
    attacker.set("topic/t6/n", b"not-a-number")
    assert [m["slot"] for m in inbox.poll()] == ["1.1"]
    agent.post("t6", kind="exit", slot="0.1", code=-9)
    assert [m["slot"] for m in inbox.poll()] == ["0.1"]
    assert agent.mended == 1 and coordinator.mended == 1
    # Control: a channel that cannot connect again fails on the poisoned counter.
    control = Channel(connect(*address, timeout_s=10), b"job-secret")
    connect(*address, timeout_s=10).set("topic/t6/n", b"not-a-number")
    with pytest.raises(Exception):
        control.post("t6", kind="exit", slot="0.0", code=-9)


def line_lost_to(address) -> Channel:
    """A channel whose line to the store at ``address`` failed (its old
    connection is of no use; a line back is a new one)."""
    return Channel(None, b"job-secret", address=address, cut_off_s=2.0)


def test_a_line_cut_and_healed_comes_back_to_the_primary_where_it_stood():
    """No standby took over (none is reachable here): once the primary
    answers again the channel goes on with it, its readers where they were."""
    port = free_port()
    server = Channel(connect("127.0.0.1", port, timeout_s=10, is_master=True), b"job-secret")
    lost = line_lost_to(("127.0.0.1", port))
    server.post("t7", kind="kill_all")
    lost.store = connect("127.0.0.1", port, timeout_s=10)
    commands = lost.reader("t7")
    assert [m["kind"] for m in commands.poll()] == ["kill_all"]
    lost.store = None  # the cut
    server.post("t7", kind="stop")
    assert next_coordinator(lost, ("127.0.0.1", free_port()), wait_s=10) is lost
    assert lost.store is not None and [m["kind"] for m in commands.poll()] == ["stop"]


def standby_store(taken_over: bool):
    port = free_port()
    standby = Channel(connect("127.0.0.1", port, timeout_s=10, is_master=True), b"job-secret")
    if taken_over:
        standby.put(GEN_KEY, gen=3)
    return standby, ("127.0.0.1", port)


def test_a_line_to_a_primary_that_does_not_answer_goes_to_the_standby_once_it_took_over():
    standby, address = standby_store(taken_over=True)
    lost = line_lost_to(("127.0.0.1", free_port()))  # nobody listens there: the primary is gone
    channel = next_coordinator(lost, address, wait_s=10, vote=LostPrimary(node=2))
    assert channel is not lost and channel.address == address and channel.cut_off_s == 2.0
    assert [m["node"] for m in standby.reader(STANDBY_TOPIC).poll()] == [2]


def test_a_voter_never_goes_back_to_the_primary():
    """An agent that voted waits for the takeover alone, even if the primary
    answers again: the standby may take over on its vote. Control: a rank
    (no vote) goes back."""
    for vote, back in ((LostPrimary(node=2), False), (None, True)):
        _, address = standby_store(taken_over=False)
        port = free_port()
        lost = line_lost_to(("127.0.0.1", port))
        held = []  # the primary's server, listening from 1 s on
        serve = lambda: held.append(connect("127.0.0.1", port, is_master=True))  # noqa: E731
        later = threading.Timer(1.0, serve)
        later.start()
        found = next_coordinator(lost, address, wait_s=4, vote=vote)
        later.join()
        assert (found is lost) == back and (found is None) == (not back), vote


def test_a_line_lost_after_the_job_ended_says_so():
    standby, address = standby_store(taken_over=False)
    standby.put(ENDED_KEY, why="the job ended in generation 4")
    lost = line_lost_to(("127.0.0.1", free_port()))
    with pytest.raises(JobEnded, match="generation 4"):
        next_coordinator(lost, address, wait_s=10, vote=LostPrimary(node=2))
