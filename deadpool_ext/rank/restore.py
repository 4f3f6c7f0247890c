"""Put a verified snapshot back into live training objects (which may be
freshly built), so training continues the same curve bit for bit: a rank's
own snapshot or its buddy's copy as it is, or, after a shrink or grow, the
position's shards gathered, laid out in the new buckets and sliced again.
"""

from typing import Collection, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron.training import optimizer_layout, rank_state
from megatron.training.config import Config
from megatron.training.training import Progress, Trainer

from deadpool_ext.protocol import Action, Decision
from deadpool_ext.state import reshard
from deadpool_ext.state import snapshot as snap
from deadpool_ext.state.mirror import Mirror
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


def restore_from_mirror(
    trainer: Trainer,
    mirror: Mirror,
    layout: snap.ShardLayout,
    lost: Collection[int],
    iteration: int,
) -> str:
    """A hot swap's restore, collective over the pairs of the ``lost``
    ranks (their processes new) and their buddies, then over data-parallel
    peers: a lost rank takes the copy its buddy holds, sent over their pair
    group and verified; any other its own snapshot of ``iteration``. The
    mirror then starts afresh from the restored snapshot. Returns where
    this rank's state came from: "buddy" or "own"."""
    rank = trainer.runtime.rank
    requests = []
    for lost_rank in lost:  # the buddy sends its copy to the new process
        if mirror.owner == lost_rank and rank != lost_rank:
            held = mirror.held[mirror.find("held", iteration)]
            requests.append(dist.isend(held, lost_rank, group=mirror.group_with(lost_rank)))
    if rank in lost:
        source, index = "buddy", 0
        buddy = mirror.buddy
        requests.append(dist.irecv(mirror.own[0], buddy, group=mirror.group_with(buddy)))
    else:
        source, index = "own", mirror.find("own", iteration)
    for request in requests:
        request.wait()
    restore_snapshot(trainer, layout, mirror.own[index], iteration=iteration)
    mirror.resume(index)
    return source


def config_grid(config: Config) -> Grid:
    p = config.parallel
    return Grid(
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        config.data_parallel_size,
        p.use_tp_pp_dp_mapping,
    )


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
    R, runtime, grid = decision.rollback_to, trainer.runtime, config_grid(trainer.config)
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
