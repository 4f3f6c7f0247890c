"""Resizing the job: a survivor's side of a shrink or a grow, and the side
of a spare that a grow brings in. Each enters the new world, builds its
model and optimizer again for it, takes its share of the optimizer state,
and resumes.

Rebuilding rather than patching keeps it simple and complete: every rank,
size, shard range, bucket padding and gradient scale that megatron-core
cached for the old data-parallel size is made anew by the same code that
made it at start. The model's weights need no transfer: the re-sharded fp32
main parameters are gathered into the new model as after any optimizer step.
"""

import dataclasses
import time
from typing import List, Optional, Tuple

from megatron.training import optimizer_layout
from megatron.training.config import Config, WorldLayout
from megatron.training.training import Trainer

from deadpool_ext.config import DeadpoolConfig, experts_of, section
from deadpool_ext.protocol import Action, Decision
from deadpool_ext.rank.generation import (
    enter_generation,
    position_groups,
    recording_groups,
    records_groups,
)
from deadpool_ext.rank.hooks import Builders, RankHooks
from deadpool_ext.rank.restore import contributions, grid_of, restore_resharded
from deadpool_ext.state import reshard
from deadpool_ext.state import snapshot as snap
from deadpool_ext.topology import expert_dp_groups


def world_config(config: Config, world: Optional[dict]) -> Config:
    """The config of the world a job runs in after a shrink or grow: its
    size, and the node of every rank (buddies are placed by it); unchanged
    before the first."""
    if not world or world["size"] == config.world_size and world.get("nodes") is None:
        return config
    # A smaller job may have no buddy layout across nodes; a same-node buddy
    # still covers the loss of a single rank.
    deadpool = dataclasses.replace(section(config), deadpool_allow_same_node_buddy=True)
    return dataclasses.replace(
        config,
        world_size=world["size"],
        run=dataclasses.replace(config.run),
        world=WorldLayout(list(world["nodes"]), config.planned_world_size),
        extensions={**config.extensions, DeadpoolConfig: deadpool},
    )


def expert_peers(config: Config, ring: List[int], rank: int) -> List[int]:
    """The ranks of ``ring`` (a position's DP ranks, in DP order) that hold
    ``rank``'s experts, in expert-DP order (which is DP order): whose
    shards make up its expert buckets' full state. Empty for a dense model."""
    experts = experts_of(config)
    if experts is None:
        return []
    p = config.parallel
    group_of = expert_dp_groups(
        config.world_size, experts, p.pipeline_model_parallel_size, p.use_tp_pp_dp_mapping
    )
    return [r for r in ring if group_of[r] == group_of[rank]]


def rebuild_for(
    ctx, config: Config, builders: Builders, datasets, decision: Decision, rank: int
) -> Tuple[Trainer, RankHooks]:
    """This rank's trainer and hooks in the decision's world."""
    enter_generation(ctx, config, decision, rank, decision.world_size)
    with recording_groups(ctx.generation, enabled=records_groups(config)):
        trainer, hooks = builders.build(config, ctx, datasets=datasets, joining=True)
        trainer.setup()
    return trainer, hooks


def resize(rec, decision: Decision) -> Tuple[Trainer, RankHooks]:
    """A survivor of the old world (shrink or grow), ``rec`` its Recovery:
    its trainer and hooks in the new world, restored (``rec`` then adopts
    them and ``finish``es)."""
    old: Trainer = rec.trainer
    old_rank, R = old.runtime.rank, decision.rollback_to
    old_layout, old_mirror = rec.mirror_hook.layout, rec.mirror
    tp, _, pp = grid_of(old.config).coords(old_rank)
    ring = [grid_of(old.config).rank(tp, d, pp) for d in range(decision.old_dp)]
    mine = contributions(rec, decision, ring)
    old_buckets = optimizer_layout.buckets(old.state.model, old.state.optimizer)
    config = world_config(old.config, decision.world())
    # The new last rank appends to the metrics file and dashboards: close ours first.
    old.close_logs()
    rec.events.close()
    trainer, hooks = rebuild_for(
        rec.ctx,
        config,
        rec.builders,
        (old.train_ds, old.valid_ds, old.test_ds),
        decision,
        decision.renumber[old_rank],
    )
    groups = position_groups(grid_of(config), set(decision.renumber.values()))
    buffers = reshard.gather_position(
        old_layout, mine, decision.sources, ring, decision.renumber, R, groups[0]
    )
    shards = [snap.regions(b, old_layout) for b in buffers]
    experts = [shards[ring.index(r)] for r in expert_peers(old.config, ring, old_rank)]
    state = optimizer_layout.full_state(old_buckets, shards, experts)
    sidecar = snap.read_sidecar(buffers[ring.index(old_rank)], old_layout)
    del buffers
    restore_resharded(trainer, hooks.mirror.layout, decision, groups, state, sidecar)
    if old_mirror is not None:
        old_mirror.close()
    return trainer, hooks


def grow_into(
    ctx, config: Config, builders: Builders, datasets, decision: Decision
) -> Tuple[Trainer, RankHooks]:
    """A spare that a grow brings in: its trainer and hooks in the grown
    world, restored from the state its position's first rank sends."""
    config = world_config(config, decision.world())
    trainer, hooks = rebuild_for(
        ctx, config, builders, datasets, decision, decision.rank_of(ctx.slot)
    )
    groups = position_groups(grid_of(config), set(decision.renumber.values()))
    restore_resharded(trainer, hooks.mirror.layout, decision, groups, None, None)
    return trainer, hooks


def finish(rec, decision: Decision, start: float, old_rank: Optional[int]) -> None:
    R = decision.rollback_to
    rec.enter_built(decision)
    rec.resume_at(decision)
    verb = "grew" if decision.action == Action.GROW else "shrank"
    rec.emit(
        "grown" if decision.action == Action.GROW else "shrunk",
        action=decision.action,
        old_rank=old_rank,
        rollback_to=R,
        dp_before=decision.old_dp,
        dp_after=decision.new_dp,
        world_size=decision.world_size,
        planned_world_size=rec.config.world.planned_world_size,
        ms=round((time.monotonic() - start) * 1e3, 1),
    )
    p = rec.config.parallel
    planned = rec.config.planned_world_size // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    )
    if decision.action == Action.CHECKPOINT:
        rec.logger.warning(
            "deadpool: generation %d gathered the state of %d data-parallel "
            "replicas on %d, to save iteration %d",
            decision.gen,
            decision.old_dp,
            decision.new_dp,
            R,
        )
        return
    rec.logger.warning(
        "deadpool: generation %d %s the job from %d to %d data-parallel "
        "replicas (launched with %d); resuming at iteration %d",
        decision.gen,
        verb,
        decision.old_dp,
        decision.new_dp,
        planned,
        R + 1,
    )
