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
from typing import List, Optional, Tuple

from megatron.training import optimizer_layout
from megatron.training.config import Config, WorldLayout
from megatron.training.training import Trainer

from deadpool_ext.config import DeadpoolConfig, experts_of, section
from deadpool_ext.protocol import Decision
from deadpool_ext.rank.generation import (
    enter_generation,
    position_groups,
    recording_groups,
    records_groups,
)
from deadpool_ext.rank.hooks import Builders, MirrorHook, RankHooks
from deadpool_ext.rank.restore import config_grid, restore_resharded
from deadpool_ext.state import reshard
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
        run=dataclasses.replace(config.run),  # the new world's trainer sets its own
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


def holdings(old: Trainer, mirror_hook: MirrorHook) -> reshard.Holdings:
    """What this survivor brings of its position's old state to a resize."""
    rank, grid = old.runtime.rank, config_grid(old.config)
    tp, _, pp = grid.coords(rank)
    ring = [grid.rank(tp, d, pp) for d in range(grid.dp)]
    return reshard.Holdings(
        mirror_hook.layout,
        mirror_hook.mirror,
        ring,
        rank,
        optimizer_layout.buckets(old.state.model, old.state.optimizer),
        expert_peers(old.config, ring, rank),
    )


def rebuild_for(
    ctx, config: Config, builders: Builders, datasets, decision: Decision, rank: int
) -> Tuple[Trainer, RankHooks]:
    """This rank's trainer and hooks in the decision's world (``config``:
    the one before it)."""
    config = world_config(config, decision.world())
    enter_generation(ctx, config, decision, rank, decision.world_size)
    with recording_groups(ctx.generation, enabled=records_groups(config)):
        trainer, hooks = builders.build(config, ctx, datasets=datasets, joining=True)
        trainer.setup()
    return trainer, hooks


def resize(
    ctx, builders: Builders, old: Trainer, old_hooks: RankHooks, decision: Decision
) -> Tuple[Trainer, RankHooks]:
    """A survivor of the old world (shrink or grow): its trainer and hooks
    in the new world, restored from its position's old snapshots."""
    held = holdings(old, old_hooks.mirror)
    # The new last rank appends to the metrics file and dashboards: close ours first.
    old.close_logs()
    old_hooks.mirror.events.close()
    datasets = (old.train_ds, old.valid_ds, old.test_ds)
    new_rank = decision.renumber[held.rank]
    trainer, hooks = rebuild_for(ctx, old.config, builders, datasets, decision, new_rank)
    groups = position_groups(config_grid(trainer.config), set(decision.renumber.values()))
    state, sidecar = reshard.gather_state(held, decision, groups[0])
    restore_resharded(trainer, hooks.mirror.layout, decision, groups, state, sidecar)
    if held.mirror is not None:
        held.mirror.close()
    return trainer, hooks


def grow_into(
    ctx, config: Config, builders: Builders, datasets, decision: Decision
) -> Tuple[Trainer, RankHooks]:
    """A spare that a grow brings in: its trainer and hooks in the grown
    world, restored from the state its position's first rank sends."""
    rank = decision.rank_of(ctx.slot)
    trainer, hooks = rebuild_for(ctx, config, builders, datasets, decision, rank)
    groups = position_groups(config_grid(trainer.config), set(decision.renumber.values()))
    restore_resharded(trainer, hooks.mirror.layout, decision, groups, None, None)
    return trainer, hooks
