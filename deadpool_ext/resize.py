"""A survivor's side of a shrink: enter the smaller world, build this rank's
model and optimizer again for it, move the optimizer state over, resume.

Rebuilding rather than patching keeps it simple and complete: every rank,
size, shard range, bucket padding and gradient scale that megatron-core
cached for the old data-parallel size is made anew by the same code that
made it at start. The model's weights need no transfer: the re-sharded fp32
main parameters are gathered into the new model as after any optimizer step.
"""

import dataclasses
import time
from typing import List, Optional

from megatron.training.config import Config
from megatron.training.training import Trainer, build_trainer

from deadpool_ext import reshard
from deadpool_ext import snapshot as snap
from deadpool_ext.config import section
from deadpool_ext.plan import Decision
from deadpool_ext.restore import restore_snapshot
from deadpool_ext.shrink import Grid, world_of


def world_config(config: Config, world: Optional[dict]) -> Config:
    """The config of the world a job runs in after a shrink: its size, and
    the node of every rank (buddies are placed by it); unchanged before."""
    if not world or world["size"] == config.world_size and world.get("nodes") is None:
        return config
    extra = dict(config.extra)
    extra.setdefault("planned_world_size", config.world_size)
    extra["rank_nodes"] = list(world["nodes"])
    # A smaller job may have no buddy layout across nodes; a same-node buddy
    # still covers the loss of a single rank.
    extra["deadpool"] = dataclasses.replace(section(config),
                                            deadpool_allow_same_node_buddy=True)
    return dataclasses.replace(config, world_size=world["size"], extra=extra)


def grid_of(config: Config) -> Grid:
    p = config.parallel
    return Grid(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                config.data_parallel_size, p.use_tp_pp_dp_mapping)


def contributions(rec, decision: Decision, ring: List[int]) -> dict:
    """The old snapshots of this position that this rank broadcasts."""
    me, mirror, R = rec.trainer.runtime.rank, rec.mirror, decision.rollback_to
    mine = {}
    for old_rank in ring:
        contributor, kind = decision.sources[old_rank]
        if contributor == me:
            buffers = mirror.own if kind == "own" else mirror.held
            mine[old_rank] = buffers[mirror.find(kind, R)]
    return mine


def shrink(rec, decision: Decision) -> None:
    start = time.monotonic()
    old: Trainer = rec.trainer
    old_rank, R = old.runtime.rank, decision.rollback_to
    old_layout, old_mirror = rec.mirror_hook.layout, rec.mirror
    tp, _, pp = grid_of(old.config).coords(old_rank)
    ring = [grid_of(old.config).rank(tp, d, pp) for d in range(decision.old_dp)]
    mine = contributions(rec, decision, ring)
    old_buckets = reshard.buckets(old.state.model, old.state.optimizer)
    config = world_config(old.config, world_of(decision))
    # The new last rank appends to the metrics file: close ours first.
    if old.metrics is not None:
        old.metrics.close()
    rec.events.close()
    rec.enter_generation(decision, decision.renumber[old_rank], decision.world_size)
    model_provider, forward_step, make_hooks = rec.builders
    hooks = make_hooks(config, rec.ctx)
    trainer = build_trainer(config, model_provider, forward_step, list(hooks),
                            datasets=(old.train_ds, old.valid_ds, old.test_ds))
    trainer.joining = True
    trainer.setup()
    buffers = reshard.gather_position(old_layout, mine, decision.sources, ring,
                                      decision.renumber, R)
    state = reshard.full_state(old_buckets, [snap.regions(b, old_layout) for b in buffers])
    sidecar = snap.read_sidecar(buffers[ring.index(old_rank)], old_layout)
    del buffers
    layout = hooks[0].layout or snap.build_layout(trainer.state.optimizer)
    regions = reshard.new_shard(reshard.buckets(trainer.state.model, trainer.state.optimizer),
                                state, trainer.runtime.dp_rank, config.data_parallel_size)
    buffer = reshard.build_snapshot(layout, regions, sidecar, R, trainer.runtime.rank)
    restore_snapshot(trainer, layout, buffer, iteration=R)
    if old_mirror is not None:
        old_mirror.close()
    rec.slots = None
    rec.adopt(trainer, *hooks)
    finish(rec, decision, start, old_rank)


def finish(rec, decision: Decision, start: float, old_rank: int) -> None:
    R = decision.rollback_to
    rec.ctx.gen = decision.gen
    rec.resume_at(decision)
    rec.emit("shrunk", old_rank=old_rank, rollback_to=R, dp_before=decision.old_dp,
             dp_after=decision.new_dp, world_size=decision.world_size,
             ms=round((time.monotonic() - start) * 1e3, 1))
    rec.logger.warning("deadpool: generation %d shrank the job to %d of %d data-parallel "
                       "replicas; resuming at iteration %d", decision.gen, decision.new_dp,
                       decision.old_dp, R + 1)
