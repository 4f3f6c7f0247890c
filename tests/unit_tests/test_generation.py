"""Releasing ranks blocked on an old generation (deadpool_ext.rank.generation).

Three gloo processes. Ranks 0 and 1 enter an all-reduce; rank 2 is alive
but never joins it (a survivor blocked elsewhere). A forked child of every
rank holds copies of all its sockets, as the data loader's workers do.
Rank 2 then stops using the generation:

  * with ``Generation.release()`` (what tear_down and the heartbeat thread
    do), rank 0 and rank 1 are released by the closed connection, long
    before the group's timeout;
  * negative control: rank 2 merely drops the group, as recovery did
    before; the forked child keeps the sockets open, and ranks 0 and 1 are
    released only by the group's timeout.
"""

import datetime
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from deadpool_ext import protocol as P
from deadpool_ext.protocol import Where
from deadpool_ext.wire import connect, control_connect, listening
from deadpool_ext.control.launch import free_port
from deadpool_ext.rank.generation import Generation
from deadpool_ext.sockets import shut_down, socket_descriptors

GROUP_TIMEOUT_S = 20


def built_generation(rank: int, port: int, world_size: int, timeout_s: float) -> Generation:
    """Generation 0 of a gloo world, as a worker builds it."""
    generation = Generation()
    generation.begin(0)
    store = connect("127.0.0.1", port, is_master=rank == 0, timeout_s=30)
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("gen0/", store),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    generation.built()
    return generation


def _rank(rank: int, port: int, how: str, results) -> None:
    release = how != "drop-only"
    generation = built_generation(rank, port, 3, GROUP_TIMEOUT_S)
    group = None  # the default group
    if how == "release-late":  # made after the generation was built, as mid-training
        group = dist.new_group([0, 1, 2], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    child = os.fork()
    if child == 0:  # holds every socket, like a data-loader worker
        time.sleep(GROUP_TIMEOUT_S + 10)
        os._exit(0)
    try:
        if rank == 2:
            time.sleep(1.0)
            if release:
                generation.release(by="test")
            else:
                dist.destroy_process_group()
            results[rank] = "left"
            time.sleep(GROUP_TIMEOUT_S + 5)  # alive, never joining
            return
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(8), group=group)
            results[rank] = "completed"
        except RuntimeError as error:
            results[rank] = f"{time.monotonic() - start:.1f}s {error}"
    finally:
        os.kill(child, 9)


def run_ranks(target, ranks: int, wanted: int, limit_s: float, *args) -> dict:
    """``target(rank, port, *args, results)`` in forked processes, until
    ``wanted`` ranks have put their result (or ``limit_s``); then kill all."""
    port = free_port()
    with mp.Manager() as manager:
        results = manager.dict()
        procs = [
            mp.get_context("fork").Process(target=target, args=(r, port, *args, results))
            for r in range(ranks)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + limit_s
        while len(results) < wanted and time.monotonic() < deadline:
            time.sleep(0.1)
        out = dict(results)
        for p in procs:
            p.kill()
            p.join()
    return out


def run_three(how: str) -> dict:
    return run_ranks(_rank, 3, 3, GROUP_TIMEOUT_S + 20, how)


@pytest.mark.integration
@pytest.mark.parametrize("how", ["release", "release-late", "drop-only"])
def test_a_live_rank_that_leaves_releases_its_blocked_peers(how):
    """release-late: ranks 0 and 1 are blocked in a group made after the
    generation was built (its connections opened after ``built``), and rank
    2's release shuts those down too."""
    results = run_three(how)
    assert results[2] == "left"
    for rank in (0, 1):
        if how != "drop-only":
            assert "Connection closed" in results[rank] or "Connection reset" in results[rank], (
                results
            )
        else:  # the negative control: only the group's own timeout frees them
            assert "Timed out" in results[rank], results


SEND_TIMEOUT_S = 5


def _sender(rank: int, port: int, queued: bool, results) -> None:
    """Rank 0 sends 64 MB to rank 1 and releases its generation 1 s later.
    queued: rank 1 posted the receive and stopped reading mid-transfer (the
    rest of the send waits in gloo's transmit queue); else rank 1 is alive
    but never posts the receive (the send waits in gloo's pending list)."""
    generation = built_generation(rank, port, 2, SEND_TIMEOUT_S)
    size = 16 << 20
    if rank == 1:
        if queued:
            dist.irecv(torch.zeros(size), 0)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(SEND_TIMEOUT_S + 10)
        return
    time.sleep(1.0)
    threading.Timer(1.0, generation.release, ("test",)).start()
    start = time.monotonic()
    try:
        dist.isend(torch.ones(size), 1).wait()
        results[rank] = "completed"
    except RuntimeError as error:
        results[rank] = (time.monotonic() - start, str(error))


@pytest.mark.integration
@pytest.mark.parametrize("queued", [False, True], ids=["pending", "queued"])
def test_gloo_never_fails_a_send_queued_for_a_busy_socket(queued):
    """Why the release cannot free everything on gloo, and why a stuck
    survivor is killed (docs/reliability.md): a release fails a send still
    waiting for its receiver at once, but not a send of which gloo queued
    the rest for a full socket; that one waits out the group's timeout.
    When torch fixes this, the "queued" case fails here: then a stuck
    survivor should not happen on gloo any more."""
    out = run_ranks(_sender, 2, 1, SEND_TIMEOUT_S + 20, queued)
    seconds, error = out[0]
    if queued:
        assert seconds >= SEND_TIMEOUT_S - 0.5 and "Timed out" in error, out
    else:
        assert seconds < 2.0 and "Connection closed" in error, out


@pytest.fixture()
def listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def connected(listener):
    """Both ends of a new loopback TCP connection."""
    client = socket.create_connection(listener.getsockname())
    return client, listener.accept()[0]


def test_shut_down_touches_only_connected_tcp_sockets(listener):
    client, server = connected(listener)
    left, right = socket.socketpair()  # a unix socket
    try:
        assert not shut_down(listener.fileno())
        assert not shut_down(left.fileno())
        assert shut_down(client.fileno())
        assert server.recv(1) == b""  # the peer sees the end of the stream
        assert client.fileno() in socket_descriptors().values()  # still open here
    finally:
        for s in (client, server, left, right):
            s.close()


def serve_store(port: int) -> subprocess.Popen:
    """A store's server in a process of its own, as the coordinator's is."""
    code = "from deadpool_ext.wire import connect; import time; "
    code += f"store = connect('127.0.0.1', {port}, is_master=True); time.sleep(60)"
    server = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not listening("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.1)
    return server


@pytest.mark.integration  # the store's server runs in a process of its own, as in a job
def test_a_generation_releases_what_it_opened_but_the_control_plane(listener):
    before = connected(listener)
    port = free_port()
    server = serve_store(port)
    generation = Generation()
    generation.begin(3)
    ours = connected(listener)
    generation.built()
    later = connected(listener)  # a pair its groups connected on first use
    control = control_connect("127.0.0.1", port, timeout_s=30)  # a fail-over's
    again = ()
    try:
        assert generation.size()["connections"] == 2  # made while building
        assert generation.release_if_older(3, by="test") == 0  # not older: kept
        # both ends of ours and of later (the test opened both)
        assert generation.release_if_older(4, by="test") == 4
        assert ours[1].recv(1) == b"" and later[1].recv(1) == b""
        before[1].setblocking(False)
        with pytest.raises(BlockingIOError):  # still connected, nothing sent
            before[1].recv(1)
        control.set("still", "there")  # the control plane's connection is left alone
        assert control.get("still") == b"there"
        assert generation.released == {"by": "test", "connections": 4, "open": 4}
        assert generation.release_if_older(5, by="test") == 0  # once
        again = connected(listener)  # opened after the release: a second one shuts it
        assert generation.release(by="tear_down") == 2
        assert again[1].recv(1) == b""
    finally:
        server.kill()
        for s in before + ours + later + again:
            s.close()


def test_a_rank_still_training_after_an_announcement_reports_its_stacks():
    from deadpool_ext.rank.client import ControlClient

    ctx = object.__new__(ControlClient)  # the watch alone, no store
    ctx.gen, ctx.state, ctx._announced, ctx.stuck_after_s = 0, "training", None, 0.05
    seen = []
    ctx.on_stuck = lambda gen, stacks: seen.append((gen, stacks))
    ctx._report_if_stuck({"gen": 1, "grow": True})  # a grow waits for the boundary
    ctx._report_if_stuck({"gen": 1})
    assert seen == []
    time.sleep(0.1)
    ctx._report_if_stuck({"gen": 1})
    ctx._report_if_stuck({"gen": 1})  # once per generation
    assert len(seen) == 1 and seen[0][0] == 1
    assert "test_a_rank_still_training_after_an_announcement_reports_its_stacks" in seen[0][1]
    ctx.state = "recovering"  # the main thread got out: nothing to report
    ctx._report_if_stuck({"gen": 2})
    time.sleep(0.1)
    ctx._report_if_stuck({"gen": 2})
    assert len(seen) == 1


def test_the_heartbeat_thread_releases_an_old_generation_only_after_the_grace(monkeypatch):
    """Live peers first finish the transfer they are in: a release in the
    middle of it would leave the sender's queued send to the group timeout."""
    from deadpool_ext.rank import client as worker

    class Recorded:
        calls = []

        def release_if_older(self, newer, by, keep=frozenset()):
            assert not keep  # nothing may be kept: every group goes
            self.calls.append((newer, by))

    monkeypatch.setattr(worker.P, "RELEASE_GRACE_S", 0.1)
    ctx = object.__new__(worker.ControlClient)  # the watch alone, no store
    ctx.generation, ctx._superseded, ctx.release_error = Recorded(), None, None
    ctx.keepable = None
    ctx._release_if_superseded({"gen": 1, "grow": True})  # a grow: at the boundary
    ctx._release_if_superseded({"gen": 1})
    assert Recorded.calls == []
    time.sleep(0.15)
    ctx._release_if_superseded({"gen": 1})
    assert Recorded.calls == [(1, "heartbeat thread")]
    ctx._release_if_superseded({"gen": 2})  # a newer failure: a grace of its own
    assert Recorded.calls == [(1, "heartbeat thread")]


def test_with_groups_to_keep_the_heartbeat_spares_them_until_the_main_thread_blocks(monkeypatch):
    """--deadpool-rebuild-groups changed: after the grace only groups with a
    lost member are shut down (a main thread blocked in one is freed, the
    groups that may be kept stay whole). RELEASE_ALL_AFTER_S after the
    announcement a main thread that still computes is let go on; once it
    waits on a peer it is blocked in a group that could be kept, and
    everything is released."""
    from deadpool_ext.rank import client as worker

    class Recorded:
        calls = []

        def sockets_of(self, keys):
            return {101, 102} if keys == ["0,1#0"] else set()

        def release_if_older(self, newer, by, keep=frozenset()):
            self.calls.append(sorted(keep))

    monkeypatch.setattr(worker.P, "RELEASE_GRACE_S", 0.1)
    monkeypatch.setattr(worker.P, "RELEASE_ALL_AFTER_S", 0.3)
    main_thread = [Where.COMPUTE]
    monkeypatch.setattr(worker.whereabouts, "where", lambda thread: main_thread[0])
    ctx = object.__new__(worker.ControlClient)
    ctx.generation, ctx._superseded, ctx.release_error = Recorded(), None, None
    ctx._main_thread = threading.main_thread().ident
    asked = []
    ctx.keep_groups_with(lambda lost: asked.append(list(lost)) or ["0,1#0"])
    ctx._release_if_superseded({"gen": 1, "lost": [3]})
    time.sleep(0.15)
    ctx._release_if_superseded({"gen": 1, "lost": [3]})
    assert Recorded.calls == [[101, 102]] and asked == [[3]]
    time.sleep(0.2)
    ctx._release_if_superseded({"gen": 1, "lost": [3]})  # computing: not blocked yet
    assert Recorded.calls == [[101, 102]] * 2
    main_thread[0] = Where.COMMUNICATION
    ctx._release_if_superseded({"gen": 1, "lost": [3]})
    assert Recorded.calls == [[101, 102]] * 2 + [[]] and ctx.release_error is None


def test_a_main_thread_is_released_whole_once_blocked_or_past_the_bound():
    """Blocked: waiting on a peer, checkpointing, or with no Python frame to
    tell; a thread that reads as computing goes only past the bound (a spin
    on a GPU stream reads so)."""
    from deadpool_ext.rank.client import releases_all

    early, due, late = (
        P.RELEASE_ALL_AFTER_S / 2,
        P.RELEASE_ALL_AFTER_S,
        P.RELEASE_ALL_COMPUTING_AFTER_S,
    )
    assert not any(releases_all(early, where) for where in (*Where, None))
    assert [releases_all(due, where) for where in (*Where, None)] == [False, True, True, True]
    assert all(releases_all(late, where) for where in (*Where, None))
    assert (
        P.RELEASE_ALL_AFTER_S
        < P.RELEASE_ALL_COMPUTING_AFTER_S
        < P.HEARTBEAT_TIMEOUT_S * P.STUCK_REPORT_TIMEOUTS
    )


def test_when_the_store_is_gone_the_heartbeat_thread_frees_the_main_thread_which_leaves():
    """The launcher that hosts the store and the coordinator is gone: the
    heartbeat thread releases the generation (a collective would fail) and
    stops; the main thread's next contact with the control plane raises
    WorkerExit(FAILED), which only the worker's main turns into an exit."""
    from deadpool_ext.protocol import ExitCode, Role, WorkerEnv
    from deadpool_ext.rank.client import ControlClient
    from deadpool_ext.rank.errors import WorkerExit
    from deadpool_ext.wire import SECRET_ENV

    port = free_port()
    server = connect("127.0.0.1", port, timeout_s=10, is_master=True)
    env = WorkerEnv("0.0", Role.ACTIVE, 0, f"127.0.0.1:{port}", 1, 1, 0).variables()
    ctx = ControlClient({**env, SECRET_ENV: "s"}, heartbeat_s=0.05)
    released = []
    ctx.generation.release = lambda by: released.append(by)
    try:
        assert ctx.failure_announced() is False and ctx.current()["gen"] == 0
        del server  # the store's server goes with its launcher
        ctx._thread.join(timeout=10)
        assert not ctx._thread.is_alive()
        assert released == ["heartbeat thread: the coordinator is gone"]
        assert ctx.coordinator_lost.startswith("the coordinator is gone")
        for contact in (ctx.failure_announced, ctx.current):
            with pytest.raises(WorkerExit) as leaving:
                contact()
            assert leaving.value.code == ExitCode.FAILED
    finally:
        ctx.stop()
