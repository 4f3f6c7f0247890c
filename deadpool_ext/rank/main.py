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
import time
from typing import NoReturn


from megatron.training import data
from megatron.training.config import Config
from megatron.training.initialize import setup_device
from megatron.training.log import get_logger
from megatron.training.tokenizer import build_tokenizer
from megatron.training.training import NothingToResume, say_nothing_to_resume

from deadpool_ext import protocol as P
from deadpool_ext.config import section
from deadpool_ext.inject import Injector, parse_faults, spares_ready_at
from deadpool_ext.lifetime import die_with_parent
from deadpool_ext.protocol import (
    Action,
    ExitCode,
    Role,
    WorkerEnv,
    WorkerState,
)
from deadpool_ext.rank import rebuild, recovery
from deadpool_ext.rank.errors import Failure, WorkerExit, classify, summary, traceback_text
from deadpool_ext.rank.generation import (
    open_default_group,
    recording_groups,
    records_groups,
)
from deadpool_ext.rank.client import ControlClient
from deadpool_ext.rank.hooks import (
    Builders,
    ComputeClock,
    FaultHook,
    MirrorHook,
    RankHooks,
    RecoveryHook,
    replica_check,
)
from deadpool_ext.rank.sample_rng import SampleRngHook
from deadpool_ext.wire import (
    leave,
)


def build_hooks(config: Config, ctx: ControlClient, injector: Injector) -> RankHooks:
    """The hooks a rank trains with."""
    mirror_hook = MirrorHook(config, recovers=True)
    dp = section(config)
    clock = ComputeClock(ctx, dp.deadpool_straggler_window)
    return RankHooks(
        mirror_hook,
        RecoveryHook(ctx, mirror_hook, config),
        FaultHook(injector, ctx, mirror_hook, clock),
        SampleRngHook(config) if dp.deadpool_sample_rng else None,
        replica_check(config),
        clock,
    )


def start_active(ctx: ControlClient, config: Config, builders: Builders):
    setup_device(config)
    open_default_group(ctx, config, 0, ctx.env.rank, config.world_size)
    with recording_groups(ctx.generation, enabled=records_groups(config)):
        trainer, hooks = builders.build(config, ctx)
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


def wait_as_injected(ctx: ControlClient, config: Config) -> None:
    """--deadpool-inject slow-warm: this node's spares stay warming until the
    named generation trains (held back by the test, not left to timing)."""
    gen = spares_ready_at(parse_faults(section(config).deadpool_inject), ctx.node)
    if gen is None:
        return

    def trains() -> bool:
        latest = ctx.current()
        return latest["gen"] >= gen and latest["state"] == P.JobState.TRAINING

    why = f"generation {gen} to train (--deadpool-inject slow-warm)"
    get_logger(0).info("warm spare %s waits for %s", ctx.slot, why)
    ctx.wait(trains, 24 * 3600, why)


def start_spare(ctx: ControlClient, config: Config, builders: Builders):
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
    wait_as_injected(ctx, config)
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
    except WorkerExit as leaving:
        get_logger(0).error("deadpool: slot %s stops: %s", os.environ.get("DEADPOOL_SLOT"), leaving)
        leave(leaving.code)
    try:
        train(ctx, config, model_provider, forward_step)
    except WorkerExit as leaving:
        say_why_it_leaves(ctx, leaving)
        leave(leaving.code)
    except NothingToResume as stop:  # every rank finds the same --load: the job ends
        say_nothing_to_resume(stop, ctx.env.rank)
        ctx.state = WorkerState.DONE
        ctx.post(P.Done(rank=ctx.env.rank, slot=ctx.slot))
    except Exception as error:  # noqa: BLE001 - every failure leaves with a typed code
        leave(report_failure(ctx, error))
    ctx.stop()
    leave(ExitCode.OK)  # as the agent does, for the same reason


def say_why_it_leaves(ctx: ControlClient, leaving: WorkerExit) -> None:
    """A worker that leaves other than as released or stopped by the
    decision's words (already said) says why, in its log."""
    if leaving.code in (ExitCode.OK, ExitCode.RELEASED, ExitCode.ABORTED):
        return
    if ctx.env.error_file:  # why, for the coordinator's event
        with open(ctx.env.error_file, "w") as f:
            f.write(str(leaving))
    get_logger(0).error(
        "deadpool: slot %s leaves (exit code %d): %s", ctx.slot, leaving.code, leaving
    )


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
    make_hooks = functools.partial(build_hooks, injector=injector)
    builders = Builders(model_provider, forward_step, make_hooks)
    if ctx.role == Role.ACTIVE:
        rec = start_active(ctx, config, builders)
    else:
        rec = start_spare(ctx, config, builders)
    rec.train()
    ctx.state = WorkerState.DONE
    ctx.post(P.Done(rank=rec.trainer.runtime.rank, slot=ctx.slot))
