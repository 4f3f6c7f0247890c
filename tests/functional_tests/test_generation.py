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

The release also shuts what a generation opened but the control plane
(with the store's server in a process of its own, as in a job). What a
rank does in-process (which sockets it shuts, the heartbeat thread's
watch) is in tests/unit_tests/test_sockets.py and
tests/unit_tests/rank/test_client.py and test_generation.py.
"""

import datetime
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from deadpool_ext.wire import connect, control_connect, listening
from deadpool_ext.control.ports import free_port
from deadpool_ext.rank.generation import Generation
from tests.unit_tests.test_sockets import connected, listener  # noqa: F401  (a fixture)

pytestmark = pytest.mark.integration

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


def serve_store(port: int) -> subprocess.Popen:
    """A store's server in a process of its own, as the coordinator's is."""
    code = "from deadpool_ext.wire import connect; import time; "
    code += f"store = connect('127.0.0.1', {port}, is_master=True); time.sleep(60)"
    server = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not listening("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.1)
    return server


# The store's server runs in a process of its own, as in a job.
def test_a_generation_releases_what_it_opened_but_the_control_plane(listener):  # noqa: F811  (the fixture)
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
