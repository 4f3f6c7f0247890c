"""What deadpool adds to the training loop, as trainer hooks:

* ``MirrorHook``: snapshot at every iteration start, hold the optimizer
  step until the shard is copied out, report in the log line;
* ``RecoveryHook``: progress for the heartbeats, a failure announced by
  the coordinator seen between microbatches, the buddy plan for the
  coordinator, the first iteration after a recovery (with its
  ``RecoveryReport`` on the job's dashboards);
* ``FaultHook``: where ``--deadpool-inject`` faults fire;
* ``ComputeClock``: each iteration's compute time (forward and backward,
  before the gradient reduction's waits), for the straggler watch;
* ``sample_rng.SampleRngHook``: each training microbatch's random
  draws seeded from its sample (--deadpool-sample-rng);
* and ``sdc.ReplicaDigestCheck``: the parameters' digests against the
  other data-parallel replicas' at every iteration's start.
"""

import collections
import dataclasses
import socket
import statistics
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.training import rank_state
from megatron.training.arguments import ConfigError
from megatron.training.config import Config
from megatron.training.log import get_logger
from megatron.training.training import Hook, Trainer, build_trainer

from deadpool_ext import protocol as P
from deadpool_ext.config import nodes_are_emulated, plan_buddies, resize_limits, section
from deadpool_ext.events import EventLog
from deadpool_ext.inject import Fault, Injector, fire, free_disk
from deadpool_ext.protocol import WorkerState
from deadpool_ext.rank.flips import flip
from deadpool_ext.rank.generation import FailureAnnounced
from deadpool_ext.state import snapshot as snap
from deadpool_ext.rank.generation import open_mirror_groups
from deadpool_ext.rank.sample_rng import SampleRngHook
from deadpool_ext.rank.sdc import ReplicaDigestCheck
from deadpool_ext.state.mirror import Mirror
from deadpool_ext.topology import BuddyMap


def replay_state(trainer: Trainer) -> dict:
    """What exact replay needs beside the optimizer shard, as of now (the
    start of an iteration)."""
    return {
        "progress": dataclasses.asdict(trainer.progress),
        "rng": rank_state.rng_state(),
        "model_buffers": rank_state.model_buffers(trainer.state),
        **rank_state.schedule_state(trainer.state),
    }


def runtime_buddies(config: Config) -> BuddyMap:
    """The plan checked in parse_args, confirmed with real hostnames unless
    nodes are emulated (a multi-node job whose hosts hold uneven rank blocks
    gets its buddies from the hostnames)."""
    planned = plan_buddies(config)
    if nodes_are_emulated(config):
        return planned
    hosts: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    try:
        return plan_buddies(config, hosts=hosts)
    except ConfigError as error:
        raise ConfigError(f"--deadpool: {error}") from None


class MirrorHook(Hook):
    def __init__(self, config: Config, recovers: bool = False):
        """recovers: a recovery redoes an iteration whose step the buddy's
        replay doubts (deadpool-launch); else the mirror only resyncs."""
        self.config, self.recovers = config, recovers
        self.mirror: Optional[Mirror] = None
        self.layout: Optional[snap.ShardLayout] = None
        self.events: Optional[EventLog] = None
        self.buddies: Optional[BuddyMap] = None

    def on_setup(self, trainer: Trainer) -> None:
        dp, rank = section(self.config), trainer.runtime.rank
        logger = get_logger(rank)
        self.events = EventLog(dp.deadpool_events, rank)
        self.layout = snap.build_layout(trainer.state.optimizer)
        device = (
            None if trainer.runtime.on_cpu else torch.device("cuda", torch.cuda.current_device())
        )
        in_device = dp.deadpool_mirror_memory == "device"
        if self.config.data_parallel_size < 2:
            # Only a job shrunk to one replica gets here (parse_args refuses
            # DP=1): there is no peer to mirror to, and a lost rank ends the
            # job. Own snapshots are still taken: a grow starts from them.
            logger.warning(
                "deadpool mirror: one data-parallel replica is left; own snapshots only, no buddy"
            )
            self.events.emit("mirror_local", reason="one data-parallel replica left")
            self.mirror = Mirror(
                trainer.state.optimizer,
                self.layout,
                rank,
                rank,
                rank,
                open_mirror_groups(self.config, None),
                self.events,
                device,
                dp.deadpool_mirror_mode,
            )
            self.mirror.allocate("device" if in_device else "cpu")
            return
        buddies = self.buddies = runtime_buddies(self.config)
        self.mirror = Mirror(
            trainer.state.optimizer,
            self.layout,
            rank,
            buddies.buddy[rank],
            buddies.owner[rank],
            open_mirror_groups(self.config, buddies),
            self.events,
            device,
            dp.deadpool_mirror_mode,
            raise_on_divergence=self.recovers,
        )
        self.mirror.allocate("device" if in_device else "cpu")
        if buddies.same_node:
            logger.warning(
                "--deadpool-allow-same-node-buddy: some buddies share a node with "
                "their owner; losing that node loses their state"
            )
        logger.info(
            "deadpool mirror: buddy %d, owner %d, snapshot %.1f MB, %.1f MB extra (%s memory), "
            "sends %s",
            buddies.buddy[rank],
            buddies.owner[rank],
            self.layout.nbytes / 2**20,
            self.mirror.extra_bytes / 2**20,
            dp.deadpool_mirror_memory,
            "the whole shard" if dp.deadpool_mirror_mode == "state" else "the step's gradients",
        )
        self.events.emit(
            "mirror_ready",
            buddy=buddies.buddy[rank],
            owner=buddies.owner[rank],
            shard_elements=self.layout.numel,
            snapshot_bytes=self.layout.nbytes,
            extra_bytes=self.mirror.extra_bytes,
            memory=dp.deadpool_mirror_memory,
            mode=dp.deadpool_mirror_mode,
            same_node=buddies.same_node,
        )

    def before_step(self, trainer: Trainer) -> None:
        if self.mirror is not None:
            self.mirror.start(trainer.progress.iteration, replay_state(trainer))

    def before_optimizer_step(self, trainer: Trainer) -> None:
        if self.mirror is not None:
            self.mirror.wait_exchanged()
            self.mirror.note_step()

    def log_fields(self, trainer: Trainer) -> List[str]:
        if self.mirror is None:
            return ["mirror: off"]
        if self.mirror.local:
            return ["mirror: local"]
        held = self.mirror.held_iteration()
        return [f"mirror held: {'-' if held is None else held}"]

    def on_train_end(self, trainer: Trainer) -> None:
        """Mirror the final state too, so the buddies hold where training ended."""
        if self.mirror is None:
            self.events.close()
            return
        self.mirror.start(trainer.progress.iteration, replay_state(trainer))
        self.mirror.wait_idle()
        self.events.emit(
            "mirror_done", iteration=trainer.progress.iteration, held=self.mirror.held_iteration()
        )
        corruption, self.mirror.corruption = self.mirror.corruption, None
        if corruption is not None:
            # The last step is checked after training ended (and after the
            # final save): nothing is left to redo it in.
            get_logger(trainer.runtime.rank).error("deadpool: after the last step: %s", corruption)
            self.events.emit(
                "sdc_detected",
                check=corruption.check,
                iteration=corruption.iteration,
                suspects=corruption.suspects,
                action="none: training had ended",
                error=str(corruption),
            )
        self.mirror.close()
        self.events.close()


# Recovery stages on the dashboards: event -> name.
DASHBOARD_STAGES = {
    "groups_torn_down": "teardown",
    "groups_rebuilt": "rebuild",
    "state_restored": "restore",
    "shrunk": "resize",
    "grown": "resize",
}


@dataclasses.dataclass(frozen=True)
class RecoveryReport:
    """A recovery as the job's TensorBoard / W&B show it, written by the
    last rank after the first iteration it completes."""

    decision: P.Decision
    data_parallel_size: int  # the world's the rank resumed in
    world_size: int
    failure_seen_at: Optional[float]  # time.monotonic(); None: a spare saw no failure
    stage_ms: Dict[str, float]  # the recovery's stages, by event, as the rank timed them

    def dashboard(self) -> Tuple[Dict[str, float], str]:
        """Scalars and a line, as of now."""
        decision = self.decision
        values = {
            "deadpool/generation": decision.gen,
            "deadpool/data-parallel-size": self.data_parallel_size,
            "deadpool/world-size": self.world_size,
            "deadpool/rollback-iteration": decision.rollback_to,
        }
        if self.failure_seen_at is not None:
            values["deadpool/recovery-seconds"] = time.monotonic() - self.failure_seen_at
        for event, stage in DASHBOARD_STAGES.items():
            if event in self.stage_ms:
                values[f"deadpool/{stage}-ms"] = self.stage_ms[event]
        line = f"generation {decision.gen}: {decision.action.value}"
        line += f" ({decision.reason})" if decision.reason else ""
        line += f", training goes on after iteration {decision.rollback_to}"
        if decision.action.resizes:
            line += f", data-parallel size {decision.old_dp} -> {decision.new_dp}"
        if decision.gpus or decision.withheld:
            values["deadpool/spares-withheld"] = len(decision.withheld)
        for slot, gpu in sorted(decision.gpus.items()):
            line += f"; spare {slot}'s {gpu}"
        if decision.withheld:
            line += (
                f"; spares not used, their GPU failing its check: {', '.join(decision.withheld)}"
            )
        return values, line


class RecoveryHook(Hook):
    """Heartbeat progress, failure announcements between iterations, the
    buddy plan for the coordinator, and the first iteration after a recovery."""

    def __init__(self, ctx, mirror_hook: MirrorHook, config: Config):
        self.ctx, self.mirror_hook, self.config = ctx, mirror_hook, config
        self.recovered_at: Optional[float] = None
        self.report: Optional[RecoveryReport] = None  # of the recovery, for the dashboards

    def on_setup(self, trainer: Trainer) -> None:
        """Rank 0 tells the coordinator the layout: at start, and after a
        shrink (a spare that took rank 0 repeats it; only the first counts)."""
        self.ctx.iteration = trainer.progress.iteration
        if trainer.runtime.rank != 0:
            return
        buddies, ranks = self.mirror_hook.buddies, range(trainer.runtime.world_size)
        p = self.config.parallel
        self.ctx.post(
            P.Plan(
                gen=self.ctx.gen,
                buddy=[buddies.buddy[r] for r in ranks] if buddies else None,
                owner=[buddies.owner[r] for r in ranks] if buddies else None,
                tp=p.tensor_model_parallel_size,
                pp=p.pipeline_model_parallel_size,
                tp_pp_dp=p.use_tp_pp_dp_mapping,
                distributed_timeout_minutes=p.distributed_timeout_minutes,
                train_iters=self.config.training.train_iters,
                saves=bool(self.config.checkpoint.save),
                **resize_limits(self.config, buddies),
            )
        )

    def log_fields(self, trainer: Trainer) -> List[str]:
        planned = self.config.planned_world_size
        if planned == self.config.world_size:
            return []
        p = self.config.parallel
        per_replica = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        return [
            f"shrunk: data-parallel size {self.config.data_parallel_size} of "
            f"{planned // per_replica} ({self.config.world_size} of {planned} ranks)"
        ]

    def before_step(self, trainer: Trainer) -> None:
        self.ctx.iteration = trainer.progress.iteration
        self.ctx.state = WorkerState.TRAINING
        if self.ctx.failure_announced():
            why = " (at the iteration boundary)" if self.ctx.boundary_announced() else ""
            raise FailureAnnounced(
                f"the coordinator announced generation {self.ctx.latest['gen']}{why}"
            )

    def before_microbatch(self, trainer: Trainer) -> None:
        """A survivor computing its own microbatches would notice a failure
        only at its next collective with the lost ranks (for a pipeline
        stage, at the end of backward): look at the announced generation
        before every microbatch instead. A grow, a drain or a stop waits for
        the boundary."""
        if self.ctx.failure_announced() and not self.ctx.boundary_announced():
            raise FailureAnnounced(f"the coordinator announced generation {self.ctx.latest['gen']}")

    def resumed(self, report: RecoveryReport) -> None:
        """A recovery ended here: the next step's time is reported, with
        the report's scalars and line on the job's dashboards."""
        self.recovered_at, self.report = time.monotonic(), report

    def after_step(self, trainer: Trainer, metrics: dict) -> None:
        self.ctx.iteration = trainer.progress.iteration
        if self.recovered_at is not None:
            seconds = time.monotonic() - self.recovered_at
            self.mirror_hook.events.emit(
                "first_iteration_after_recovery",
                gen=self.ctx.gen,
                iteration=trainer.progress.iteration,
                seconds=round(seconds, 3),
            )
            self.recovered_at = None
            values, line = self.report.dashboard()
            values["deadpool/first-iteration-seconds"] = seconds
            trainer.dashboards.scalars(values, trainer.progress.iteration, None)
            trainer.dashboards.text("deadpool/recovery", line, trainer.progress.iteration)


class ComputeClock(Hook):
    """Times each iteration's compute: from its first microbatch to the end
    of backward, before the gradient reduction, where a rank waits for its
    slowest data-parallel peer. (With pipeline stages the time includes
    their sends and receives; a tensor-parallel group's waits stay inside
    its node.) The heartbeats carry the median of the last ``window``
    iterations to the coordinator's straggler watch. Called after every
    other hook, so that what they do in the window (an injected slowdown)
    counts."""

    def __init__(self, ctx, window: int):
        self.ctx = ctx
        self.times = collections.deque(maxlen=window)
        self.started: Optional[float] = None

    def before_step(self, trainer: Trainer) -> None:
        self.started = None

    def before_microbatch(self, trainer: Trainer) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def before_grad_reduce(self, trainer: Trainer) -> None:
        if self.started is None:
            return
        self.times.append(time.perf_counter() - self.started)
        self.ctx.compute = {
            "seconds": round(statistics.median(self.times), 6),
            "count": len(self.times),
            "iteration": trainer.progress.iteration + 1,
        }

    def elapsed(self) -> float:
        """The iteration's compute so far."""
        return 0.0 if self.started is None else time.perf_counter() - self.started


class FaultHook(Hook):
    """Fires the ``--deadpool-inject`` faults at their phase; the iteration
    is Megatron's 1-based number of the iteration in progress."""

    def __init__(
        self,
        injector: Injector,
        ctx,
        mirror_hook: MirrorHook,
        clock: Optional[ComputeClock] = None,
    ):
        self.injector, self.ctx, self.mirror_hook = injector, ctx, mirror_hook
        self.clock = clock
        self.trainer: Optional[Trainer] = None

    def on_setup(self, trainer: Trainer) -> None:
        self.trainer = trainer
        mirror = self.mirror_hook.mirror
        if mirror is not None and self.injector.faults:
            mirror.register_exchange_hook(lambda iteration: self.at("mirror", iteration + 1))

    def current(self) -> int:
        return self.trainer.progress.iteration + 1

    def before_step(self, trainer: Trainer) -> None:
        self.at("start", self.current())

    def before_microbatch(self, trainer: Trainer) -> None:
        self.at("forward", self.current())

    def after_forward(self, trainer: Trainer, output) -> None:
        if self.injector.faults and output.requires_grad:
            output.register_hook(lambda grad: self.at("backward", self.current()) or grad)
        for fault in self.injector.due("output", self.current()):
            if not fault.persistent:
                self.injector.fired.add(fault)
            self.emitted(fault, self.current())
            output.data.fill_(float("nan"))  # what the loss check then finds

    def before_grad_reduce(self, trainer: Trainer) -> None:
        self.at("grad-reduce", self.current())
        self.slow_down(self.current())

    def slow_down(self, iteration: int) -> None:
        """slow:node=N:iter=I:factor=F: from iteration I on, this rank's
        compute takes F times as long (it sleeps the difference at the end
        of backward, inside the compute the clock times)."""
        factor = self.injector.slowdown(iteration)
        if factor > 1 and self.clock is not None:
            if not self.injector.slowed:
                self.injector.slowed = True
                self.emitted(self.injector.slow_fault(), iteration)
            time.sleep((factor - 1) * self.clock.elapsed())

    def before_param_sync(self, trainer: Trainer) -> None:
        self.at("optimizer", self.current())

    def after_step(self, trainer: Trainer, metrics: dict) -> None:
        self.at("after-step", trainer.progress.iteration)

    def before_save(self, trainer: Trainer) -> None:
        self.at("save", trainer.progress.iteration)

    def after_save(self, trainer: Trainer, outcome) -> None:
        if any(f.action == "disk-full" for f in self.injector.fired):
            free_disk()

    def at(self, phase: str, iteration: Optional[int] = None) -> None:
        for fault in self.injector.due(phase, iteration):
            if phase not in ("mirror", "recovery") and self.mirror_hook.mirror is not None:
                # Let the iteration's starting snapshot reach the buddy, so
                # the run redoes exactly the interrupted iteration.
                self.mirror_hook.mirror.wait_idle()
            if phase == "start" and fault.action != "drain":
                self.wait_for_the_node(fault)
            self.injector.fired.add(fault)
            if fault.action == "drain":
                self.emitted(fault, iteration)
                self.ask_for_drain(fault)
                continue
            if fault.action == "flip":
                self.emitted(
                    fault,
                    iteration,
                    **flip(fault, self.trainer, self.mirror_hook.mirror, iteration),
                )
                continue
            self.emitted(fault, iteration)
            if fault.delay_ms:
                threading.Timer(fault.delay_ms / 1e3, fire, (fault,)).start()
            else:
                fire(fault)

    def ask_for_drain(self, fault: Fault) -> None:
        """What deadpool-ctl drain sends (every rank of the node asks; the
        coordinator takes the first)."""
        request = P.ControlRequest(
            request=P.Request.DRAIN.value,
            nonce=f"inject-{self.ctx.slot}",
            node=fault.node,
            reason=f"--deadpool-inject {fault.action}:node={fault.node}:iter={fault.iteration}",
            by="--deadpool-inject",
        )
        self.ctx.request(request)

    def emitted(self, fault: Fault, iteration: Optional[int], **details) -> None:
        self.mirror_hook.events.emit(
            "fault_injected",
            gen=self.ctx.gen,
            iteration=iteration,
            action=fault.action,
            phase=fault.phase,
            node=fault.node,
            delay_ms=fault.delay_ms,
            **({"target": fault.target, **details} if fault.action == "flip" else {}),
        )

    def wait_for_the_node(self, fault: Fault) -> None:
        """A node dies once all its ranks are at the kill point (in forward,
        pipeline stages would wait on each other)."""
        key = f"inject/{fault}"
        self.ctx.add(key, 1)
        deadline = time.monotonic() + 10  # a rank replaced earlier never comes
        while self.ctx.add(key, 0) < self.ranks_on_this_node() and time.monotonic() < deadline:
            time.sleep(0.005)

    def ranks_on_this_node(self) -> int:
        """In the current world (a resized one names each rank's node)."""
        nodes = self.trainer.config.world.rank_nodes
        if nodes is None:
            return self.ctx.env.ranks_per_node
        return sum(1 for name in nodes if name == f"node{self.ctx.node}")


def replica_check(config: Config) -> Optional[ReplicaDigestCheck]:
    interval = config.training.check_weight_hash_across_dp_replicas_interval
    return None if interval is None else ReplicaDigestCheck(interval)


def deadpool_hooks(config: Config) -> list:
    """Under torchrun: the mirror, the draws that follow the sample as under
    deadpool-launch (the same curve either way), and the replicas' digests
    (a difference stops the run: nothing redoes the iteration)."""
    dp = section(config)
    if not dp.deadpool:
        return []
    keyed = [SampleRngHook(config)] if dp.deadpool_sample_rng else []
    check = replica_check(config)
    return keyed + ([check] if check is not None else []) + [MirrorHook(config)]


@dataclasses.dataclass(frozen=True)
class RankHooks:
    """The hooks a rank trains with, in the order the trainer calls them."""

    mirror: MirrorHook
    recovery: RecoveryHook
    faults: FaultHook
    sample_rng: Optional[Hook] = None  # --deadpool-sample-rng (sample_rng.py)
    replicas: Optional[Hook] = None  # the parameters' digests (sdc.py)
    clock: Optional[ComputeClock] = None  # the straggler watch's compute time

    def all(self) -> List[Hook]:
        """The replicas are checked before the mirror snapshots the state;
        the clock comes last, so that the compute it times includes the
        other hooks' (an injected slowdown's)."""
        first = [h for h in (self.sample_rng, self.replicas) if h is not None]
        last = [self.clock] if self.clock is not None else []
        return first + [self.mirror, self.recovery, self.faults] + last


@dataclasses.dataclass(frozen=True)
class Builders:
    """What a rank builds its trainer from, at start and again for each new
    world (a spare's, a shrink's, a grow's): the script's model provider and
    forward step, and the maker of its hooks (``make_hooks(config, ctx)``)."""

    model_provider: Callable
    forward_step: Callable
    make_hooks: Callable[[Config, object], RankHooks]

    def build(self, config: Config, ctx, datasets=None, joining=False) -> Tuple[Trainer, RankHooks]:
        """A trainer and its hooks, not set up yet (its groups come first)."""
        hooks = self.make_hooks(config, ctx)
        trainer = build_trainer(
            config,
            self.model_provider,
            self.forward_step,
            hooks.all(),
            datasets=datasets,
            joining=joining,
        )
        return trainer, hooks
