"""A worker's line to the coordinator (``ControlClient``): the store
client the main thread posts and reads through, and the heartbeat thread
that beats, watches the generation, releases a superseded one, and moves
to the standby when the primary goes."""

import faulthandler
import os
import tempfile
import threading
import time
from typing import Callable, Collection, List, Optional, Tuple

import torch.distributed as dist

from deadpool_ext import protocol as P
from deadpool_ext.defaults import (
    HEARTBEAT_INTERVAL_S,
    RELEASE_ALL_AFTER_S,
    RELEASE_ALL_COMPUTING_AFTER_S,
    RELEASE_GRACE_S,
    SILENT_PEER_REPORT_S,
    STORE_RECONNECT_TIMEOUT_S,
)
from deadpool_ext.protocol import Decision, ExitCode, Where, WorkerEnv, WorkerState
from deadpool_ext.rank import whereabouts
from deadpool_ext.rank.errors import WorkerExit, summary
from deadpool_ext.rank.generation import Generation
from deadpool_ext.sockets import local_host, silent_peers
from deadpool_ext.wire import (
    Channel,
    JobEnded,
    connect,
    control_connect,
    job_secret,
    listening,
    next_coordinator,
    standby_channel,
)


def releases_all(waited_s: float, main_thread: Optional[Where]) -> bool:
    """Whether a release ``waited_s`` after a failure's announcement also
    shuts the groups a hot swap may keep: only a main thread blocked in one
    needs it, and one that computes (``main_thread``) is not blocked yet."""
    if waited_s >= RELEASE_ALL_COMPUTING_AFTER_S:
        return True
    return waited_s >= RELEASE_ALL_AFTER_S and main_thread != Where.COMPUTE


class ControlClient:
    """This process's line to the coordinator, plus a heartbeat thread that
    also watches the generation (so a failure is noticed between iterations
    even by ranks no collective has failed yet).

    Which thread touches what: the main thread alone writes ``gen``,
    ``iteration`` and ``state`` (the heartbeat thread reads them, each a
    single assignment) and registers the callbacks (``watch_stuck``,
    ``keep_groups_with``) before training; the heartbeat thread alone writes
    ``latest``, ``coordinator_lost`` and ``release_error``, and moves
    ``channel`` to the standby, which the main thread waits for
    (``_await_fail_over``)."""

    def __init__(self, environ=os.environ, heartbeat_s: float = HEARTBEAT_INTERVAL_S):
        self.env = WorkerEnv.read(environ)
        self.slot, self.role, self.node = self.env.slot, self.env.role, self.env.node
        secret = job_secret(environ)
        self.channel, self._beat_channel = self.first_channels(secret)
        self.store_address = self.channel.address
        # Set by the heartbeat thread when the store (and with it the
        # coordinator) is gone; the main thread then leaves.
        self.coordinator_lost: Optional[str] = None
        self.no_fail_over: Optional[str] = None  # why the heartbeat thread did not move
        # The groups this process holds or is building, and their sockets.
        self.generation = Generation()
        self.release_error: Optional[str] = None
        # A rank still training this long after a failure was announced is
        # stuck where a release cannot reach: its stacks go to on_stuck once.
        self.stuck_after_s: Optional[float] = None
        self.on_stuck: Optional[Callable[[int, str], None]] = None
        # --deadpool-rebuild-groups changed: the keys of the groups a release
        # spares, given the lost ranks (set by the rank's Recovery).
        self.keepable: Optional[Callable[[Collection[int]], List[str]]] = None
        self._announced: Optional[tuple] = None  # (generation, when seen)
        self._superseded: Optional[tuple] = None  # (newer generation, when seen)
        self.heartbeat_s = heartbeat_s
        self.gen = 0  # the generation this process trains in
        self.iteration = None  # last started iteration, for the coordinator
        # Its compute time per iteration (hooks.ComputeClock), for the straggler watch.
        self.compute: Optional[dict] = None
        self._host: Optional[str] = None  # this host's address on the groups' connections
        self.state = WorkerState.STARTING
        self.latest = {"gen": 0, "state": P.JobState.STARTING}
        self._main_thread = threading.main_thread().ident
        self._switched = threading.Event()  # the channels moved to the standby
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="deadpool-heartbeat", daemon=True)
        self._thread.start()

    def first_channels(self, secret: bytes) -> Tuple[Channel, Channel]:
        """The main thread's and the heartbeat thread's channels to the
        primary's store; to the standby's once it took over if the primary
        is gone or does not answer (a spare still starting when node 0
        died: connecting to a dead store retries for a minute)."""
        primary, standby = self.env.store_address, self.env.standby_address
        if standby is None:
            return self._channel(primary, secret), self._channel(primary, secret)
        quick = STORE_RECONNECT_TIMEOUT_S
        while listening(*primary):
            try:
                return (
                    self._channel(primary, secret, timeout_s=quick),
                    self._channel(primary, secret, timeout_s=quick),
                )
            except dist.DistError:
                beat = self._standby_beat(secret, wait_s=0)  # paused or gone
                if beat is not None:
                    return self._channel(standby, secret), beat
        beat = self._standby_beat(secret, self.env.takeover_wait_s)
        if beat is None:
            gone = f"the coordinator at {self.env.store} is gone and no standby took over"
            raise WorkerExit(ExitCode.FAILED, gone)
        return self._channel(standby, secret), beat

    def _channel(self, address: Tuple[str, int], secret: bytes, **connect) -> Channel:
        """A control channel to the store at ``address`` (``connect``: control_connect's)."""
        cut_off_s = self.env.cut_off_s
        store = control_connect(*address, cut_off_s=cut_off_s, **connect)
        return Channel(store, secret, address=address, cut_off_s=cut_off_s)

    def _standby_beat(self, secret: bytes, wait_s: float) -> Optional[Channel]:
        """A channel to the standby once it has taken over (within wait_s)."""
        try:
            return standby_channel(
                self.env.standby_address, secret, wait_s, cut_off_s=self.env.cut_off_s
            )
        except JobEnded as ended:
            raise WorkerExit(ExitCode.OK, str(ended)) from None

    def _beat(self, watch_s: float = 0.05) -> None:
        """Beat every heartbeat_s; read the generation every watch_s."""
        last_beat = 0.0
        while not self._stop.wait(watch_s):
            try:
                if time.monotonic() - last_beat >= self.heartbeat_s:
                    self._beat_channel.put(
                        P.worker_heartbeat_key(self.slot),
                        iteration=self.iteration,
                        state=self.state,
                        where=whereabouts.where(self._main_thread),
                        compute=self.compute,
                        **self._data_paths(),
                    )
                    last_beat = time.monotonic()
                latest = self._beat_channel.get(P.GEN_KEY)
            except dist.DistError as error:
                if self._fail_over():
                    continue
                self._lose_coordinator(error)
                return
            if latest is not None:
                self.latest = latest
                self._release_if_superseded(latest)
                self._report_if_stuck(latest)

    def _data_paths(self) -> dict:
        """What a beat says of the generation's connections: this host's
        address on them and, while training, the peer hosts that left data
        unacknowledged for a while (the coordinator finds a node cut off
        from its peers though its heartbeats arrive: policy/paths.py)."""
        connections = self.generation.connections()
        if not connections:
            return {}
        if self._host is None:
            self._host = local_host(connections)
        beat = {"host": self._host}
        if self.state == WorkerState.TRAINING:
            silent = silent_peers(connections, SILENT_PEER_REPORT_S)
            if silent:
                beat["silent"] = silent
        return beat

    def _fail_over(self) -> bool:
        """The primary coordinator is gone: go on with the standby once it
        has taken over (both channels, and the address of the rendezvous
        stores to come), or with the primary once it answers again (the line
        was cut, and is healed); False if there is no standby or neither did."""
        address = self.standby_address()
        if address is None or self.store_address == address:
            gen = self.latest.get("gen")
            self.no_fail_over = (
                f"no standby held the coordinator's copy (generation {gen})"
                if address is None
                else "the standby was lost"
            )
            return False
        secret = self.channel.secret
        try:
            beat = next_coordinator(self._beat_channel, address, self.env.takeover_wait_s)
        except JobEnded as ended:
            self.no_fail_over = str(ended)
            return False  # its agent stops it
        if beat is None:
            self.no_fail_over = (
                f"the standby at {address[0]}:{address[1]} did not take over within "
                f"{self.env.takeover_wait_s:.0f} s, or could not be reached"
            )
            return False
        try:
            main = self._channel(beat.address, secret, timeout_s=STORE_RECONNECT_TIMEOUT_S)
        except dist.DistError as error:
            self.no_fail_over = f"its store could not be reached again ({summary(error)})"
            return False
        back = beat is self._beat_channel  # the primary's again
        if back:
            main.carry_on_from(self.channel)
        elif self.state == WorkerState.SPARE:
            try:  # the standby's copy of the state may predate this spare's word
                beat.post(P.COORDINATOR_TOPIC, P.SpareReady(slot=self.slot))
            except dist.DistError as error:
                self.no_fail_over = f"the standby's store failed at once ({summary(error)})"
                return False
        self._beat_channel = beat
        self.channel = main
        self.store_address = beat.address
        self._switched.set()
        return True

    def standby_address(self) -> Optional[Tuple[str, int]]:
        """The standby that holds the coordinator's copy, as the last
        generation read names it (the agent's word until one was read)."""
        if "standby" not in self.latest:
            return self.env.standby_address
        return None if self.latest["standby"] is None else P.host_port(self.latest["standby"])

    def _lose_coordinator(self, error: Exception) -> None:
        """The store is gone, and with it the coordinator and the job: free
        the main thread from any collective of the generation (its next
        contact with the control plane then makes it leave)."""
        self.coordinator_lost = f"the coordinator is gone ({summary(error)}): {self.no_fail_over}"
        try:
            self.generation.release(by="heartbeat thread: the coordinator is gone")
        except Exception as failure:  # noqa: BLE001 - the main thread leaves all the same
            self.release_error = summary(failure)

    def _control_plane(self, use: Callable[[Channel], object]):
        """Every use of the store by the main thread. When the primary goes,
        the heartbeat thread moves both channels to the standby once it took
        over, and the use is repeated there; when no coordinator is left the
        job is gone, and this process leaves with ``ExitCode.FAILED``."""
        while self.coordinator_lost is None:
            channel = self.channel
            try:
                return use(channel)
            except dist.DistError as error:
                if not self._await_fail_over(channel) and self.coordinator_lost is None:
                    why = self.no_fail_over or (
                        "no standby"
                        if self.standby_address() is None
                        else "the heartbeat thread had not moved to the standby in time"
                    )
                    self.coordinator_lost = f"the coordinator is gone ({summary(error)}): {why}"
        raise WorkerExit(ExitCode.FAILED, self.coordinator_lost)

    def _await_fail_over(self, used: Channel) -> bool:
        """Whether the heartbeat thread moved to the standby (it tries when
        its own use of the store fails, within a watch interval)."""
        if self.standby_address() is None:
            return False
        deadline = time.monotonic() + self.env.takeover_wait_s + STORE_RECONNECT_TIMEOUT_S
        while self.channel is used and self.coordinator_lost is None:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            self._switched.wait(0.05)
        return self.channel is not used

    def _release_if_superseded(self, latest: dict) -> None:
        """A newer generation that does not stop at the boundary (a grow, a
        drain, a stop) means the groups held now
        are dead: RELEASE_GRACE_S later, shut their connections down, so a
        main thread blocked in a collective (and every peer blocked on this
        rank) is released then, not when its peers' sockets happen to close.
        Groups a hot swap may keep are spared while the main thread may still
        stop on its own (``releases_all``); a main thread blocked in a group
        with a lost member is freed without them. A boundary's generation
        lets the iteration finish; ranks release at the boundary."""
        if latest.get("boundary"):
            return
        gen = int(latest["gen"])
        if self._superseded is None or self._superseded[0] != gen:
            self._superseded = (gen, time.monotonic())
        waited = time.monotonic() - self._superseded[1]
        if waited < RELEASE_GRACE_S:
            return
        try:
            keep = set()
            if self.keepable is not None and not releases_all(
                waited, whereabouts.where(self._main_thread)
            ):
                keep = self.generation.sockets_of(self.keepable(latest.get("lost", [])))
            self.generation.release_if_older(gen, by="heartbeat thread", keep=keep)
        except Exception as error:  # noqa: BLE001 - the thread must go on beating
            # tear_down releases again, from the main thread, and reports it.
            self.release_error = summary(error)

    def _report_if_stuck(self, latest: dict) -> None:
        gen = int(latest["gen"])
        if gen <= self.gen or latest.get("boundary") or self.state != WorkerState.TRAINING:
            return
        if self._announced is None or self._announced[0] != gen:
            self._announced = (gen, time.monotonic())
        elif (
            self.stuck_after_s is not None
            and self.on_stuck is not None
            and time.monotonic() - self._announced[1] > self.stuck_after_s
        ):
            self._announced = (gen, float("inf"))  # once per generation
            self.on_stuck(gen, thread_stacks())

    def watch_stuck(self, after_s: float, on_stuck: Callable[[int, str], None]) -> None:
        """Call ``on_stuck(gen, stacks)`` once per generation when the main
        thread still trains ``after_s`` after that generation was announced."""
        self.stuck_after_s, self.on_stuck = after_s, on_stuck

    def keep_groups_with(self, keepable: Optional[Callable[[Collection[int]], List[str]]]) -> None:
        """--deadpool-rebuild-groups changed: ``keepable(lost ranks)`` names
        the groups a release spares (None: it spares none)."""
        self.keepable = keepable

    def generation_store(self):
        """A store connection of the generation's own, for its rendezvous:
        releasing the generation shuts it down too, which frees a rank
        waiting for the address of a peer that died."""
        return connect(*self.store_address)

    def post(self, message: P.Message) -> None:
        self._control_plane(lambda channel: channel.post(P.COORDINATOR_TOPIC, message))

    def request(self, message: P.ControlRequest) -> None:
        """An operator's request, on their topic (a planned event in a test)."""
        self._control_plane(lambda channel: channel.post(P.CONTROL_TOPIC, message))

    def failure_announced(self) -> bool:
        """A new generation: a failure, or one that stops at the iteration's
        end (see ``boundary_announced``)."""
        if self.coordinator_lost is not None:
            raise WorkerExit(ExitCode.FAILED, self.coordinator_lost)
        return self.latest["gen"] > self.gen

    def boundary_announced(self) -> bool:
        """The new generation grows the job, drains nodes or stops it: stop
        at the iteration's end, nobody is lost."""
        return self.failure_announced() and bool(self.latest.get("boundary"))

    def wait(self, predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
            time.sleep(0.02)

    def get(self, key: str) -> Optional[dict]:
        return self._control_plane(lambda channel: channel.get(key))

    def add(self, key: str, amount: int) -> int:
        """A plain counter of the store (fault injection's node barrier)."""
        return self._control_plane(lambda channel: channel.store.add(key, amount))

    def current(self) -> dict:
        return self.get(P.GEN_KEY) or self.latest

    def decision(self, gen: int) -> Optional[Decision]:
        body = self.get(P.decision_key(gen))
        return None if body is None else Decision.from_message(body)

    def stop(self) -> None:
        self._stop.set()


def thread_stacks() -> str:
    """Every thread's Python stack, as faulthandler prints it."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()
