"""A worker's line to the coordinator (deadpool_ext/rank/client.py),
in-process: the heartbeat thread's watch, which reports a main thread still
training after an announcement, releases an old generation only after the
grace (sparing the groups that may be kept until the main thread blocks),
and frees the main thread when the store is gone (also when the standby
that took over fails as it is reached). Releasing ranks blocked
on an old generation, with real processes, is in
tests/functional_tests/test_generation.py."""

import threading
import time

import pytest

from deadpool_ext import defaults
from deadpool_ext.protocol import Where
from deadpool_ext.wire import connect
from deadpool_ext.control.ports import free_port


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

    monkeypatch.setattr(worker, "RELEASE_GRACE_S", 0.1)
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

    monkeypatch.setattr(worker, "RELEASE_GRACE_S", 0.1)
    monkeypatch.setattr(worker, "RELEASE_ALL_AFTER_S", 0.3)
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
        defaults.RELEASE_ALL_AFTER_S / 2,
        defaults.RELEASE_ALL_AFTER_S,
        defaults.RELEASE_ALL_COMPUTING_AFTER_S,
    )
    assert not any(releases_all(early, where) for where in (*Where, None))
    assert [releases_all(due, where) for where in (*Where, None)] == [False, True, True, True]
    assert all(releases_all(late, where) for where in (*Where, None))
    assert (
        defaults.RELEASE_ALL_AFTER_S
        < defaults.RELEASE_ALL_COMPUTING_AFTER_S
        < defaults.HEARTBEAT_TIMEOUT_S * defaults.STUCK_REPORT_TIMEOUTS
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


def test_a_worker_whose_primary_dies_as_it_connects_starts_on_the_standby_that_took_over(
    monkeypatch,
):
    """A spare that starts as node 0 dies: the primary's port was found
    listening, then refuses. The worker does not wait out a minute-long
    connect: it starts on the standby once that has taken over (published
    a generation), both channels there. Control: with no takeover yet, it
    keeps trying the primary."""
    from deadpool_ext.protocol import GEN_KEY, Role, WorkerEnv
    from deadpool_ext.rank import client as worker
    from deadpool_ext.wire import SECRET_ENV, Channel

    monkeypatch.setattr(worker, "STORE_RECONNECT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(worker, "listening", lambda host, port: True)  # the look before it died
    primary, standby = free_port(), free_port()
    server = connect("127.0.0.1", standby, timeout_s=10, is_master=True)
    env = WorkerEnv(
        "2.0",
        Role.SPARE,
        2,
        f"127.0.0.1:{primary}",
        1,
        1,
        None,
        standby=f"127.0.0.1:{standby}",
        takeover_wait_s=5,
    ).variables()
    started = []
    starting = threading.Thread(
        target=lambda: started.append(worker.ControlClient({**env, SECRET_ENV: "s"})),
        daemon=True,
    )
    starting.start()
    starting.join(timeout=3)
    assert starting.is_alive() and not started  # no takeover: it keeps trying
    Channel(server, b"s").put(GEN_KEY, gen=1, standby=None)
    starting.join(timeout=10)
    assert started, "the worker did not move to the standby"
    ctx = started[0]
    try:
        assert ctx.store_address == ("127.0.0.1", standby)
        assert ctx._beat_channel.address == ("127.0.0.1", standby)
    finally:
        ctx.stop()


def test_a_spare_whose_word_the_standby_cannot_take_frees_the_main_thread(monkeypatch):
    """The primary is gone and the standby took over, but its store fails
    as the spare repeats its word (SpareReady) there: the heartbeat thread
    does not die of it (a main thread blocked in a collective would never
    be freed) but says why and frees the main thread, as when no standby
    took over."""
    import torch.distributed as dist

    from deadpool_ext.protocol import GEN_KEY, Role, WorkerEnv, WorkerState
    from deadpool_ext.rank import client as worker
    from deadpool_ext.wire import SECRET_ENV, Channel

    primary, standby = free_port(), free_port()
    primary_server = connect("127.0.0.1", primary, timeout_s=10, is_master=True)
    standby_server = connect("127.0.0.1", standby, timeout_s=10, is_master=True)
    Channel(standby_server, b"s").put(GEN_KEY, gen=1, standby=None)  # it took over

    def standby_that_fails(*args, **kwargs):
        beat = taken_over(*args, **kwargs)

        def post(*_):
            raise dist.DistNetworkError("the standby's store went at once")

        beat.post = post
        return beat

    taken_over = worker.next_coordinator
    monkeypatch.setattr(worker, "next_coordinator", standby_that_fails)
    env = WorkerEnv(
        "2.0", Role.SPARE, 2, f"127.0.0.1:{primary}", 1, 1, None,
        standby=f"127.0.0.1:{standby}", takeover_wait_s=5,
    ).variables()  # fmt: skip
    ctx = worker.ControlClient({**env, SECRET_ENV: "s"}, heartbeat_s=0.05)
    ctx.state = WorkerState.SPARE
    released = []
    ctx.generation.release = lambda by: released.append(by)
    try:
        del primary_server
        ctx._thread.join(timeout=15)
        assert not ctx._thread.is_alive()
        assert released == ["heartbeat thread: the coordinator is gone"]
        assert "the standby's store failed at once" in ctx.coordinator_lost
        assert ctx.store_address == ("127.0.0.1", primary)  # it never moved
    finally:
        ctx.stop()
