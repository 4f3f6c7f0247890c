"""One generation as a rank sees it (deadpool_ext/rank/generation.py), in a
fake world in this process: its groups recorded by members and order, kept
ones not made again, and a release that leaves a control connect under way
alone. Releasing ranks blocked on an old generation, with real processes, is
in tests/functional_tests/test_generation.py."""

import socket
import threading
import time

import pytest
import torch.distributed as dist

from deadpool_ext.rank.generation import Generation, groups_created, recording_groups
from deadpool_ext.sockets import shut_down
from tests.unit_tests.test_sockets import connected, listener  # noqa: F401  (a fixture)


class _StoreStandIn:
    def set_timeout(self, timeout):
        pass


def test_a_release_leaves_a_control_connect_under_way_alone(listener, monkeypatch):  # noqa: F811
    """The heartbeat thread reaches the standby while the main thread tears
    its generation down: the connection that control connect has opened but
    does not know as its own yet is left alone (once shut down it made the
    rank leave as if no standby had taken over); the generation's is shut
    down, and the control connection stays alone once known."""
    from deadpool_ext import wire
    from deadpool_ext.rank.generation import Generation

    opened, proceed = [], threading.Event()

    def store_opening_slowly(host, port, timeout_s, is_master):
        opened.append(socket.create_connection((host, port)))
        proceed.wait(10)
        return _StoreStandIn()

    monkeypatch.setattr(wire, "_store", store_opening_slowly)
    generation = Generation()
    generation.begin(1)
    group_end, group_peer = connected(listener)  # a connection of the generation
    generation.built()
    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    late_end = late_peer = None
    port = listener.getsockname()[1]
    connecting = threading.Thread(target=wire.control_connect, args=("127.0.0.1", port))
    connecting.start()
    try:
        while not opened:
            time.sleep(0.01)
        late_end, late_peer = connected(other)  # the generation's, opened meanwhile
        late_peer.setblocking(False)
        generation.release("tear down")
        assert group_peer.recv(1) == b""  # shut down
        assert opened[0].send(b"x") == 1  # open (once shut down, EPIPE)
        with pytest.raises(BlockingIOError):  # spared this time, as it might be the connect's
            late_peer.recv(1)
        proceed.set()
        connecting.join(10)
        # The heartbeat thread's release comes again for what was spared.
        assert generation.release_if_older(2, "again") >= 1
        assert late_peer.recv(1) == b""
        assert opened[0].send(b"x") == 1
        shut_down(opened[0].fileno())  # the control of the check above
        with pytest.raises(BrokenPipeError):
            opened[0].send(b"x")
    finally:
        proceed.set()
        for s in (group_end, group_peer, other, late_end, late_peer, *opened):
            if s is not None:
                s.close()


def test_recorded_groups_are_named_by_members_and_order_and_kept_ones_are_not_made(fake_world):
    generation, original = Generation(), dist.new_group
    generation.begin(0)
    with recording_groups(generation):
        tp = dist.new_group([0, 1])
        dist.new_group(ranks=[2, 3])
        again = dist.new_group([1, 0])
    assert set(generation.made()) == {"0,1#0", "0,1#1"}  # rank 1 holds these two
    assert generation.made()["0,1#0"] is tp and generation.made()["0,1#1"] is again
    # The next generation keeps {0, 1}#0 and (for every rank) {2, 3}#0.
    generation.begin(1, keep={"0,1#0"})
    made_before = groups_created()
    with recording_groups(generation, kept={"0,1#0", "2,3#0"}):
        assert dist.new_group([0, 1]) is tp
        assert dist.new_group([2, 3]) is dist.GroupMember.NON_GROUP_MEMBER
        fresh = dist.new_group([0, 1])
    assert fresh is not again and groups_created() == made_before + 1
    assert dist.new_group is original  # torch's own again


def test_without_recording_groups_are_made_as_always(fake_world):
    generation = Generation()
    generation.begin(0)
    with recording_groups(generation, enabled=False):
        dist.new_group([0, 1])
    assert generation.made() == {}
