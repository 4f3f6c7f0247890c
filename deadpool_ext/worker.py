"""A worker under deadpool-launch: an active rank, or a warm spare that
waits to take a lost rank's place; both then train with recovery.

Environment from the agent: DEADPOOL_SLOT (node.local), DEADPOOL_ROLE
(active or spare), DEADPOOL_STORE (host:port), DEADPOOL_SECRET, RANK and
WORLD_SIZE.
"""

import datetime
import faulthandler
import os
import signal
import tempfile
import threading
import time
from typing import Callable, List, NoReturn, Optional

import torch.distributed as dist

from megatron.training import data
from megatron.training.config import Config
from megatron.training.initialize import setup_device
from megatron.training.log import get_logger
from megatron.training.tokenizer import build_tokenizer
from megatron.training.training import Hook, Trainer, build_trainer

from deadpool_ext import recovery, resize
from deadpool_ext.agent import leave
from deadpool_ext.config import section
from deadpool_ext.control import RELEASE_GRACE_S, Channel, connect, job_secret
from deadpool_ext.hook import MirrorHook
from deadpool_ext.inject import Injector, parse_faults
from deadpool_ext.plan import Decision
from deadpool_ext.release import Generation


class ControlClient:
    """This process's line to the coordinator, plus a heartbeat thread that
    also watches the generation (so a failure is noticed between iterations
    even by ranks no collective has failed yet)."""

    def __init__(self, environ=os.environ, heartbeat_s: float = 0.5):
        self.slot, self.role = environ["DEADPOOL_SLOT"], environ["DEADPOOL_ROLE"]
        self.node = int(environ["DEADPOOL_NODE"])
        host, port = environ["DEADPOOL_STORE"].rsplit(":", 1)
        self.store_address = (host, int(port))
        secret = job_secret(environ)
        self.store = connect(host, int(port))
        self.channel = Channel(self.store, secret)
        # The groups this process holds or is building, and their sockets.
        self.generation = Generation()
        self.release_error: Optional[str] = None
        # A rank still training this long after a failure was announced is
        # stuck where a release cannot reach: its stacks go to on_stuck once.
        self.stuck_after_s: Optional[float] = None
        self.on_stuck: Optional[Callable[[int, str], None]] = None
        self._announced: Optional[tuple] = None  # (generation, when seen)
        self._superseded: Optional[tuple] = None  # (newer generation, when seen)
        # The heartbeat thread has its own connection.
        self._beat_channel = Channel(connect(host, int(port)), secret)
        self.heartbeat_s = heartbeat_s
        self.gen = 0           # the generation this process trains in
        self.iteration = None  # last started iteration, for the coordinator
        self.state = "starting"
        self.latest = {"gen": 0, "state": "starting"}
        self._seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="deadpool-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self, watch_s: float = 0.05) -> None:
        """Beat every heartbeat_s; read the generation every watch_s."""
        last_beat = 0.0
        while not self._stop.wait(watch_s):
            try:
                if time.monotonic() - last_beat >= self.heartbeat_s:
                    self._seq += 1
                    self._beat_channel.put(f"hb/{self.slot}", seq=self._seq,
                                           iteration=self.iteration, state=self.state)
                    last_beat = time.monotonic()
                latest = self._beat_channel.get("gen")
            except dist.DistError:
                # The coordinator is gone, and with it the job.
                os._exit(1)
            if latest is not None:
                self.latest = latest
                self._release_if_superseded(latest)
                self._report_if_stuck(latest)

    def _release_if_superseded(self, latest: dict) -> None:
        """A newer generation that is not a grow means the groups held now
        are dead: RELEASE_GRACE_S later, shut their connections down, so a
        main thread blocked in a collective (and every peer blocked on this
        rank) is released then, not when its peers' sockets happen to close.
        A grow lets the iteration finish; ranks release at the boundary."""
        if latest.get("grow"):
            return
        gen = int(latest["gen"])
        if self._superseded is None or self._superseded[0] != gen:
            self._superseded = (gen, time.monotonic())
        if time.monotonic() - self._superseded[1] < RELEASE_GRACE_S:
            return
        try:
            self.generation.release_if_older(gen, by="heartbeat thread")
        except Exception as error:  # noqa: BLE001 - the thread must go on beating
            # tear_down releases again, from the main thread, and reports it.
            self.release_error = f"{type(error).__name__}: {error}"

    def _report_if_stuck(self, latest: dict) -> None:
        gen = int(latest["gen"])
        if gen <= self.gen or latest.get("grow") or self.state != "training":
            return
        if self._announced is None or self._announced[0] != gen:
            self._announced = (gen, time.monotonic())
        elif self.stuck_after_s is not None and self.on_stuck is not None and \
                time.monotonic() - self._announced[1] > self.stuck_after_s:
            self._announced = (gen, float("inf"))  # once per generation
            self.on_stuck(gen, thread_stacks())

    def generation_store(self):
        """A store connection of the generation's own, for its rendezvous:
        releasing the generation shuts it down too, which frees a rank
        waiting for the address of a peer that died."""
        return connect(*self.store_address)

    def post(self, **body) -> None:
        self.channel.post("coordinator", **body)

    def failure_announced(self) -> bool:
        """A new generation: a failure, or a grow (see ``grow_announced``)."""
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

    def current(self) -> dict:
        return self.channel.get("gen") or self.latest

    def decision(self, gen: int) -> Optional[Decision]:
        body = self.channel.get(f"decision/{gen}")
        return None if body is None else Decision.from_message(body)

    def stop(self) -> None:
        self._stop.set()


def thread_stacks() -> str:
    """Every thread's Python stack, as faulthandler prints it."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


class RecoveryHook(Hook):
    """Heartbeat progress, failure announcements between iterations, the
    buddy plan for the coordinator, and the first iteration after a recovery."""

    def __init__(self, ctx: ControlClient, mirror_hook: MirrorHook, config: Config):
        self.ctx, self.mirror_hook, self.config = ctx, mirror_hook, config
        self.recovered_at: Optional[float] = None
        self.injector = None

    def on_setup(self, trainer: Trainer) -> None:
        """Rank 0 tells the coordinator the layout: at start, and after a
        shrink (a spare that took rank 0 repeats it; only the first counts)."""
        self.ctx.iteration = trainer.progress.iteration
        if trainer.runtime.rank != 0:
            return
        buddies, ranks = self.mirror_hook.buddies, range(trainer.runtime.world_size)
        p, dp = self.config.parallel, section(self.config)
        self.ctx.post(kind="plan", gen=self.ctx.gen,
                      buddy=[buddies.buddy[r] for r in ranks] if buddies else None,
                      owner=[buddies.owner[r] for r in ranks] if buddies else None,
                      tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                      tp_pp_dp=p.use_tp_pp_dp_mapping,
                      on_spares_exhausted=dp.deadpool_on_spares_exhausted,
                      heartbeat_timeout=dp.deadpool_heartbeat_timeout,
                      spare_wait=dp.deadpool_spare_wait,
                      distributed_timeout_minutes=p.distributed_timeout_minutes,
                      train_iters=self.config.training.train_iters)

    def log_fields(self, trainer: Trainer) -> List[str]:
        planned = self.config.extra.get("planned_world_size", self.config.world_size)
        if planned == self.config.world_size:
            return []
        p = self.config.parallel
        per_replica = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        return [f"shrunk: data-parallel size {self.config.data_parallel_size} of "
                f"{planned // per_replica} ({self.config.world_size} of {planned} ranks)"]

    def before_step(self, trainer: Trainer) -> None:
        self.ctx.iteration = trainer.progress.iteration
        self.ctx.state = "training"
        if self.injector is not None:
            self.injector.at("start", trainer.progress.iteration + 1)
        if self.ctx.failure_announced():
            why = " to grow the job" if self.ctx.grow_announced() else ""
            raise recovery.FailureAnnounced(f"the coordinator announced generation "
                                            f"{self.ctx.latest['gen']}{why}")

    def after_step(self, trainer: Trainer, metrics: dict) -> None:
        self.ctx.iteration = trainer.progress.iteration
        if self.recovered_at is not None:
            self.mirror_hook.events.emit(
                "first_iteration_after_recovery", gen=self.ctx.gen,
                iteration=trainer.progress.iteration,
                seconds=round(time.monotonic() - self.recovered_at, 3))
            self.recovered_at = None


def build_hooks(config: Config, ctx: ControlClient):
    mirror_hook = MirrorHook(config)
    return mirror_hook, RecoveryHook(ctx, mirror_hook, config)


def install_faults(trainer: Trainer, rec: "recovery.Recovery", original: bool) -> None:
    dp = section(trainer.config)
    events = rec.mirror_hook.events

    def record(fault, iteration):
        events.emit("fault_injected", gen=rec.ctx.gen, iteration=iteration,
                    action=fault.action, phase=fault.phase, node=fault.node,
                    delay_ms=fault.delay_ms)

    def ranks_on_this_node() -> int:
        """In the current world (a resized one names each rank's node)."""
        nodes = rec.config.extra.get("rank_nodes")
        if nodes is None:
            return int(os.environ["LOCAL_WORLD_SIZE"])
        return sum(1 for name in nodes if name == f"node{rec.ctx.node}")

    def node_barrier(fault):
        key = f"inject/{fault}"
        rec.ctx.store.add(key, 1)
        deadline = time.monotonic() + 10  # a rank replaced earlier never comes
        while rec.ctx.store.add(key, 0) < ranks_on_this_node() and \
                time.monotonic() < deadline:
            time.sleep(0.005)

    rec.injector = Injector(parse_faults(dp.deadpool_inject), trainer.runtime.rank,
                            rec.ctx.node, original, on_fire=record,
                            settle=lambda: rec.mirror.wait_idle(), node_barrier=node_barrier)
    rec.recovery_hook.injector = rec.injector
    if rec.injector.faults:
        recovery.install_fault_points(trainer, rec)


def start_active(ctx: ControlClient, config: Config, model_provider, forward_step):
    setup_device(config)
    p = config.parallel
    ctx.generation.begin(0)
    dist.init_process_group(
        p.distributed_backend, store=dist.PrefixStore("gen0/", ctx.generation_store()),
        rank=int(os.environ["RANK"]), world_size=config.world_size,
        timeout=datetime.timedelta(minutes=p.distributed_timeout_minutes))
    mirror_hook, recovery_hook = build_hooks(config, ctx)
    trainer = build_trainer(config, model_provider, forward_step, [mirror_hook, recovery_hook])
    trainer.setup()
    rec = recovery.Recovery(ctx, trainer, mirror_hook, recovery_hook,
                            builders=(model_provider, forward_step, build_hooks))
    rec.generation_built()
    install_faults(trainer, rec, original=True)
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


def start_spare(ctx: ControlClient, config: Config, model_provider, forward_step):
    """Warm up (imports, device, tokenizer, data), then wait to be assigned:
    to a lost rank (hot swap) or to a new replica (grow)."""
    logger = get_logger(0)
    setup_device(config)
    tokenizer = build_tokenizer(config.data.tokenizer_type, config.data.tokenizer_model,
                                config.data.vocab_size)
    # The active ranks write the dataset index caches first; read them after.
    ctx.wait(lambda: ctx.current()["state"] != "starting", 24 * 3600, "the job to start")
    datasets = data.build_datasets(config, tokenizer)
    ctx.state = "spare"
    # No decision before this generation can name this process (a slot that
    # served earlier may be named in old ones).
    checked = ctx.current()["gen"] - 1
    ctx.post(kind="spare_ready", slot=ctx.slot)
    logger.info("warm spare %s ready", ctx.slot)
    builders = (model_provider, forward_step, build_hooks)
    prepared = None  # (rank, world, Recovery) built ahead of the decision
    while True:
        time.sleep(0.01)
        try:
            latest = ctx.current()
            decision, checked = newest_assignment(ctx, checked, latest["gen"])
        except dist.DistError:
            # The coordinator is gone, and with it the job (at its end, the
            # first node's launcher may exit before this node's agent stops
            # us): leave as the heartbeat thread does, without a traceback.
            os._exit(1)
        world = latest.get("world")  # size and node map since the last shrink
        if decision is None:
            likely = {slot: int(rank) for rank, slot in latest.get("assign", {}).items()}
            if ctx.slot in likely and (prepared is None or prepared[:2] != (likely[ctx.slot],
                                                                            world)):
                prepared = (likely[ctx.slot], world, recovery.prepare_spare(
                    ctx, likely[ctx.slot], resize.world_config(config, world), builders,
                    datasets))
            continue
        if decision.action == "grow":
            prepared = None  # built for a hot swap that did not pick it
            return recovery.join_grown(ctx, config, builders, datasets, decision)
        rank = decision.rank_of(ctx.slot)
        if prepared is None or prepared[:2] != (rank, world):
            prepared = (rank, world, recovery.prepare_spare(
                ctx, rank, resize.world_config(config, world), builders, datasets))
        return recovery.join(prepared[2], decision)


def run(config: Config, model_provider, forward_step) -> NoReturn:
    # SIGUSR1 prints every thread's stack: what a rank is blocked in, for
    # a report of a hang (the fault campaign sends it before it gives up).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    ctx = ControlClient()
    if ctx.role == "active":
        rec = start_active(ctx, config, model_provider, forward_step)
    else:
        rec = start_spare(ctx, config, model_provider, forward_step)
        install_faults(rec.trainer, rec, original=False)
    rec.train()
    ctx.state = "done"
    ctx.post(kind="done", rank=rec.trainer.runtime.rank)
    ctx.stop()
    leave(0)  # as the agent does, for the same reason
