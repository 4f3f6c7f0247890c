"""A worker under deadpool-launch: an active rank, or a warm spare that
waits to take a lost rank's place; both then train with recovery.

Environment from the agent: DEADPOOL_SLOT (node.local), DEADPOOL_ROLE
(active or spare), DEADPOOL_STORE (host:port), DEADPOOL_SECRET, RANK and
WORLD_SIZE.
"""

import faulthandler
import functools
import os
import signal
import tempfile
import threading
import time
from typing import Callable, Collection, List, NoReturn, Optional, Tuple

import torch.distributed as dist

from megatron.training import data
from megatron.training.config import Config
from megatron.training.initialize import setup_device
from megatron.training.log import get_logger
from megatron.training.tokenizer import build_tokenizer
from megatron.training.training import NothingToResume, build_trainer, say_nothing_to_resume

from deadpool_ext import protocol as P
from deadpool_ext.config import section
from deadpool_ext.inject import Injector, parse_faults
from deadpool_ext.lifetime import die_with_parent
from deadpool_ext.protocol import (
    Action,
    Decision,
    ExitCode,
    Role,
    Where,
    WorkerEnv,
    WorkerState,
)
from deadpool_ext.rank import rebuild, recovery, whereabouts
from deadpool_ext.rank.errors import Failure, classify, summary, traceback_text
from deadpool_ext.rank.generation import (
    Generation,
    open_default_group,
    recording_groups,
    records_groups,
)
from deadpool_ext.rank.hooks import FaultHook, MirrorHook, RecoveryHook
from deadpool_ext.wire import (
    Channel,
    JobEnded,
    connect,
    control_connect,
    job_secret,
    leave,
    listening,
    standby_channel,
)


def releases_all(waited_s: float, main_thread: Optional[Where]) -> bool:
    """Whether a release ``waited_s`` after a failure's announcement also
    shuts the groups a hot swap may keep: only a main thread blocked in one
    needs it, and one that computes (``main_thread``) is not blocked yet."""
    if waited_s >= P.RELEASE_ALL_COMPUTING_AFTER_S:
        return True
    return waited_s >= P.RELEASE_ALL_AFTER_S and main_thread != Where.COMPUTE


class ControlClient:
    """This process's line to the coordinator, plus a heartbeat thread that
    also watches the generation (so a failure is noticed between iterations
    even by ranks no collective has failed yet)."""

    def __init__(self, environ=os.environ, heartbeat_s: float = P.HEARTBEAT_INTERVAL_S):
        self.env = WorkerEnv.read(environ)
        self.slot, self.role, self.node = self.env.slot, self.env.role, self.env.node
        secret = job_secret(environ)
        host, port = self.store_address = self.first_store(secret)
        self.channel = Channel(control_connect(host, port), secret, address=(host, port))
        # Set by the heartbeat thread when the store (and with it the
        # coordinator) is gone; the main thread then leaves.
        self.coordinator_lost: Optional[str] = None
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
        # The heartbeat thread has its own connection.
        self._beat_channel = Channel(control_connect(host, port), secret, address=(host, port))
        self.heartbeat_s = heartbeat_s
        self.gen = 0  # the generation this process trains in
        self.iteration = None  # last started iteration, for the coordinator
        self.state = WorkerState.STARTING
        self.latest = {"gen": 0, "state": P.JobState.STARTING}
        self._main_thread = threading.main_thread().ident
        self._switched = threading.Event()  # the channels moved to the standby
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="deadpool-heartbeat", daemon=True)
        self._thread.start()

    def first_store(self, secret: bytes) -> Tuple[str, int]:
        """The primary's store; the standby's if the primary is gone already
        (a worker that starts late: a spare still importing when node 0 died)."""
        primary, standby = self.env.store_address, self.env.standby_address
        if standby is None or listening(*primary):
            return primary
        try:
            taken_over = standby_channel(standby, secret, self.env.takeover_wait_s)
        except JobEnded as ended:
            raise recovery.WorkerExit(ExitCode.OK, str(ended)) from None
        if taken_over is None:
            gone = f"the coordinator at {self.env.store} is gone and no standby took over"
            raise recovery.WorkerExit(ExitCode.FAILED, gone)
        return standby

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

    def _fail_over(self) -> bool:
        """The primary coordinator is gone: go on with the standby once it
        has taken over (both channels, and the address of the rendezvous
        stores to come); False if there is none or it did not."""
        address = self.env.standby_address
        if address is None or self.store_address == address or not self.latest.get("standby"):
            return False  # none, this is it, or its copy fell behind (the primary said so)
        secret = self.channel.secret
        try:
            beat = standby_channel(address, secret, self.env.takeover_wait_s)
        except JobEnded:
            return False  # its agent stops it
        if beat is None:
            return False
        self._beat_channel = beat
        self.channel = Channel(control_connect(*address), secret, address=address)
        self.store_address = address
        self._switched.set()
        if self.state == WorkerState.SPARE:
            # The standby's copy of the state may predate this spare's word.
            beat.post(P.COORDINATOR_TOPIC, P.SpareReady(slot=self.slot))
        return True

    def _lose_coordinator(self, error: Exception) -> None:
        """The store is gone, and with it the coordinator and the job: free
        the main thread from any collective of the generation (its next
        contact with the control plane then makes it leave)."""
        self.coordinator_lost = f"the coordinator is gone ({summary(error)})"
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
                if not self._await_fail_over(channel):
                    self.coordinator_lost = f"the coordinator is gone ({summary(error)})"
        raise recovery.WorkerExit(ExitCode.FAILED, self.coordinator_lost)

    def _await_fail_over(self, used: Channel) -> bool:
        """Whether the heartbeat thread moved to the standby (it tries when
        its own use of the store fails, within a watch interval)."""
        if self.env.standby_address is None:
            return False
        deadline = time.monotonic() + self.env.takeover_wait_s + P.STORE_RECONNECT_TIMEOUT_S
        while self.channel is used and self.coordinator_lost is None:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            self._switched.wait(0.05)
        return self.channel is not used

    def _release_if_superseded(self, latest: dict) -> None:
        """A newer generation that is not a grow means the groups held now
        are dead: RELEASE_GRACE_S later, shut their connections down, so a
        main thread blocked in a collective (and every peer blocked on this
        rank) is released then, not when its peers' sockets happen to close.
        Groups a hot swap may keep are spared while the main thread may still
        stop on its own (``releases_all``); a main thread blocked in a group
        with a lost member is freed without them. A grow lets the iteration
        finish; ranks release at the boundary."""
        if latest.get("grow"):
            return
        gen = int(latest["gen"])
        if self._superseded is None or self._superseded[0] != gen:
            self._superseded = (gen, time.monotonic())
        waited = time.monotonic() - self._superseded[1]
        if waited < P.RELEASE_GRACE_S:
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
        if gen <= self.gen or latest.get("grow") or self.state != WorkerState.TRAINING:
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

    def generation_store(self):
        """A store connection of the generation's own, for its rendezvous:
        releasing the generation shuts it down too, which frees a rank
        waiting for the address of a peer that died."""
        return connect(*self.store_address)

    def post(self, message: P.Message) -> None:
        self._control_plane(lambda channel: channel.post(P.COORDINATOR_TOPIC, message))

    def failure_announced(self) -> bool:
        """A new generation: a failure, or a grow (see ``grow_announced``)."""
        if self.coordinator_lost is not None:
            raise recovery.WorkerExit(ExitCode.FAILED, self.coordinator_lost)
        return self.latest["gen"] > self.gen

    def grow_announced(self) -> bool:
        """The new generation grows the job: stop at the iteration's end."""
        return self.failure_announced() and bool(self.latest.get("grow"))

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


def build_hooks(config: Config, ctx: ControlClient, injector: Injector) -> tuple:
    """The hooks a rank trains with: (mirror, recovery, faults)."""
    mirror_hook = MirrorHook(config)
    return (
        mirror_hook,
        RecoveryHook(ctx, mirror_hook, config),
        FaultHook(injector, ctx, mirror_hook),
    )


def start_active(ctx: ControlClient, config: Config, builders: tuple):
    setup_device(config)
    open_default_group(ctx, config, 0, ctx.env.rank, config.world_size)
    model_provider, forward_step, make_hooks = builders
    hooks = make_hooks(config, ctx)
    with recording_groups(ctx.generation, enabled=records_groups(config)):
        trainer = build_trainer(config, model_provider, forward_step, list(hooks))
        trainer.setup()
    rec = recovery.Recovery(ctx, trainer, hooks, builders=builders)
    rec.generation_built()
    return rec


def newest_assignment(ctx: ControlClient, checked: int, gen: int):
    """The decision that names this spare, looking at the generations after
    ``checked`` up to ``gen``; and the last generation fully looked at. A
    busy spare (building its model) may see a decision only after the next
    generation began: it is a member all the same, and must join and report."""
    for g in range(checked + 1, gen + 1):
        decision = ctx.decision(g)
        if decision is None and g == gen:
            return None, g - 1  # not decided yet
        if decision is not None and ctx.slot in decision.replaced.values():
            return decision, g
        # Decided without this spare, or superseded before any decision
        # (the coordinator writes decisions only for its current generation).
    return None, gen


def start_spare(ctx: ControlClient, config: Config, builders: tuple):
    """Warm up (imports, device, tokenizer, data), then wait to be assigned:
    to a lost rank (hot swap) or to a new replica (grow)."""
    logger = get_logger(0)
    setup_device(config)
    # torch's optimizers import TorchDynamo at the first one built (1.3 s
    # here): pay it now, not while the job waits for this spare.
    import torch._dynamo  # noqa: F401

    tokenizer = build_tokenizer(config.tokenizer)
    # The active ranks write the dataset index caches first; read them after.
    ctx.wait(lambda: ctx.current()["state"] != P.JobState.STARTING, 24 * 3600, "the job to start")
    datasets = data.build_datasets(config, tokenizer)
    ctx.state = WorkerState.SPARE
    # No decision before this generation can name this process (a slot that
    # served earlier may be named in old ones).
    checked = ctx.current()["gen"] - 1
    ctx.post(P.SpareReady(slot=ctx.slot))
    logger.info("warm spare %s ready", ctx.slot)
    prepared = None  # (rank, world, Recovery) built ahead of the decision
    while True:
        time.sleep(0.01)
        # At the job's end the first node's launcher may exit before this
        # node's agent stops us: the control plane then makes us leave.
        latest = ctx.current()
        decision, checked = newest_assignment(ctx, checked, latest["gen"])
        world = latest.get("world")  # size and node map since the last shrink
        if decision is None:
            likely = {slot: int(rank) for rank, slot in latest.get("assign", {}).items()}
            if ctx.slot in likely and (
                prepared is None or prepared[:2] != (likely[ctx.slot], world)
            ):
                prepared = (
                    likely[ctx.slot],
                    world,
                    recovery.prepare_spare(
                        ctx,
                        likely[ctx.slot],
                        rebuild.world_config(config, world),
                        builders,
                        datasets,
                    ),
                )
            continue
        if decision.action == Action.GROW:
            prepared = None  # built for a hot swap that did not pick it
            return recovery.join_grown(ctx, config, builders, datasets, decision)
        rank = decision.rank_of(ctx.slot)
        if prepared is None or prepared[:2] != (rank, world):
            prepared = (
                rank,
                world,
                recovery.prepare_spare(
                    ctx, rank, rebuild.world_config(config, world), builders, datasets
                ),
            )
        return recovery.join(prepared[2], decision)


def run(config: Config, model_provider, forward_step) -> NoReturn:
    # A lost agent leaves no orphan holding its rank.
    if not die_with_parent(WorkerEnv.read().parent_pid):
        leave(ExitCode.FAILED)
    # SIGUSR1 prints every thread's stack: what a rank is blocked in, for
    # a report of a hang (the fault campaign sends it before it gives up).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        ctx = ControlClient()
    except recovery.WorkerExit as leaving:
        get_logger(0).error("deadpool: slot %s stops: %s", os.environ.get("DEADPOOL_SLOT"), leaving)
        leave(leaving.code)
    try:
        train(ctx, config, model_provider, forward_step)
    except recovery.WorkerExit as leaving:
        leave(leaving.code)
    except NothingToResume as stop:  # every rank finds the same --load: the job ends
        say_nothing_to_resume(stop, ctx.env.rank)
        ctx.state = WorkerState.DONE
        ctx.post(P.Done(rank=ctx.env.rank, slot=ctx.slot))
    except Exception as error:  # noqa: BLE001 - every failure leaves with a typed code
        leave(report_failure(ctx, error))
    ctx.stop()
    leave(ExitCode.OK)  # as the agent does, for the same reason


def report_failure(ctx: ControlClient, error: Exception) -> ExitCode:
    """A failure recovery did not handle: log it with its whole traceback;
    the exit code tells the coordinator what it was (errors.py)."""
    failure = classify(error)
    code = {
        Failure.BUG: ExitCode.BUG,
        Failure.LOCAL: ExitCode.LOCAL_FAILURE,
        Failure.NUMERIC: ExitCode.NUMERIC,
        Failure.PEER: ExitCode.FAILED,
        Failure.USAGE: ExitCode.USAGE,
    }[failure]
    if ctx.env.error_file:  # why, for the launcher's last line
        with open(ctx.env.error_file, "w") as f:
            f.write(summary(error))
    get_logger(0).error(
        "deadpool: slot %s stops (%s failure, exit code %d): %s\n%s",
        ctx.slot,
        failure.value,
        code,
        summary(error),
        traceback_text(error),
    )
    return code


def train(ctx: ControlClient, config: Config, model_provider, forward_step) -> None:
    # Faults fire only in the process that held the rank from the start:
    # a spare that replaced it redoes the iteration and must not die again.
    injector = Injector(
        parse_faults(section(config).deadpool_inject),
        ctx.env.rank,
        ctx.node,
        original=ctx.role == Role.ACTIVE,
    )
    builders = (model_provider, forward_step, functools.partial(build_hooks, injector=injector))
    if ctx.role == Role.ACTIVE:
        rec = start_active(ctx, config, builders)
    else:
        rec = start_spare(ctx, config, builders)
    rec.train()
    ctx.state = WorkerState.DONE
    ctx.post(P.Done(rank=rec.trainer.runtime.rank, slot=ctx.slot))
