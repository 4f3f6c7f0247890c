"""Entering a generation: the step every member of a new world takes,
survivor or spare, before any group of it exists."""

import datetime
import time

import torch.distributed as dist

from deadpool_ext.plan import Decision


class FailureAnnounced(RuntimeError):
    """The coordinator started a new generation (some rank was lost)."""


def enter_generation(ctx, config, decision: Decision, rank: int, world_size: int) -> None:
    """Everyone arrives (a store barrier, so a failure now is seen by
    polling), then generation N's default group under its own prefix."""
    p = config.parallel
    ctx.post(kind="joining", gen=decision.gen, rank=rank)
    while ctx.channel.get(f"join/{decision.gen}") is None:
        if ctx.current()["gen"] != decision.gen:
            raise FailureAnnounced("another failure before the rebuild")
        time.sleep(0.01)
    ctx.generation.begin(decision.gen)
    dist.init_process_group(
        p.distributed_backend,
        store=dist.PrefixStore(f"gen{decision.gen}/", ctx.generation_store()),
        rank=rank, world_size=world_size,
        timeout=datetime.timedelta(minutes=p.distributed_timeout_minutes))
