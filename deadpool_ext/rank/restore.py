"""Put a verified snapshot back into live training objects (which may be
freshly built), so training continues the same curve bit for bit: a rank's
own snapshot or its buddy's copy as it is, or, after a shrink or grow, the
position's shards gathered, laid out in the new buckets and sliced again.
"""

from typing import List, Optional

import torch
from megatron.core import parallel_state

from megatron.training import optimizer_layout, rank_state
from megatron.training.config import Config
from megatron.training.training import Progress, Trainer

from deadpool_ext.protocol import Action, Decision, Source
from deadpool_ext.state import reshard
from deadpool_ext.state import snapshot as snap
from deadpool_ext.topology import Grid


def restore_snapshot(
    trainer: Trainer, layout: snap.ShardLayout, buffer: torch.Tensor, iteration=None
) -> int:
    """Collective over data-parallel peers (the parameter all-gather).
    Returns the iteration training resumes at."""
    snap.verify(buffer, layout, iteration=iteration, owner=trainer.runtime.rank)
    side = snap.read_sidecar(buffer, layout)
    state = trainer.state
    snap.unpack_shard(state.optimizer, layout, buffer, side["steps"])
    # Main params -> model params, then the same all-gather an optimizer step
    # ends with: this also overwrites any half-applied update on the model.
    for opt in optimizer_layout.inner_optimizers(state.optimizer):
        opt._copy_main_params_to_model_params()
    for chunk in state.model:
        chunk.start_param_sync(force_sync=True)
    rank_state.load_schedule_state(state, side)
    rank_state.set_rng_state(side["rng"])
    rank_state.load_model_buffers(state, side["model_buffers"])
    trainer.restart_at(Progress(**side["progress"]))
    return trainer.progress.iteration


def grid_of(config: Config) -> Grid:
    p = config.parallel
    return Grid(
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        config.data_parallel_size,
        p.use_tp_pp_dp_mapping,
    )


def contributions(rec, decision: Decision, ring: List[int]) -> dict:
    """The old snapshots of this position that this rank broadcasts."""
    me, mirror, R = rec.trainer.runtime.rank, rec.mirror, decision.rollback_to
    mine = {}
    for old_rank in ring:
        contributor, kind = decision.sources[old_rank]
        if contributor == me:
            buffers = mirror.own if kind == Source.OWN else mirror.held
            mine[old_rank] = buffers[mirror.find(kind, R)]
    return mine


def restore_resharded(
    trainer: Trainer,
    layout: Optional[snap.ShardLayout],
    decision: Decision,
    groups,
    state: Optional[dict],
    sidecar: Optional[dict],
) -> None:
    """Lay the full state of this rank's position out in the new buckets,
    take this rank's slice, and restore it. ``state`` is None on a spare
    a grow brings in: after a grow every rank takes the position's first
    rank's copy. ``layout``: the mirror's, None without a mirror."""
    new_buckets = optimizer_layout.buckets(trainer.state.model, trainer.state.optimizer)
    layout = layout or snap.build_layout(trainer.state.optimizer)
    R, runtime, grid = decision.rollback_to, trainer.runtime, grid_of(trainer.config)
    flats = None if state is None else optimizer_layout.flat_state(new_buckets, state)
    if decision.action == Action.GROW:
        tp, _, pp = grid.coords(runtime.rank)
        flats, sidecar = reshard.share_position(
            layout, flats, sidecar, R, grid.rank(tp, 0, pp), groups[1]
        )
    expert_slice = (
        parallel_state.get_expert_data_parallel_rank(),
        parallel_state.get_expert_data_parallel_world_size(),
    )
    regions = optimizer_layout.shard_of(new_buckets, flats, runtime.dp_rank, grid.dp, expert_slice)
    buffer = reshard.build_snapshot(layout, regions, sidecar, R, runtime.rank)
    restore_snapshot(trainer, layout, buffer, iteration=R)
