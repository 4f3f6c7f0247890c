"""Re-shard the distributed optimizer's state onto a different DP size.

A snapshot's shard for DP rank k is, bucket by bucket, the slice
[k*S, (k+1)*S) of the bucket's flat buffer (S = bucket numel / DP), and
buckets follow each other in the optimizers' order (``snapshot.build_layout``).
So the DP snapshots of one (tp, pp) position, side by side, give every
bucket's full flat state; each parameter's state is cut out of it by its
place in the old buffers and put at its place in the new ones, whose padding
and shard bounds depend on the new DP size. Parameters are matched by name.

The exchange, per (tp, pp) position, over gloo (the snapshots live in host
memory, on GPU too): every old snapshot is broadcast, checksum verified,
from the rank that contributes it (``shrink.shard_sources``; after a grow,
its owner) to the position's ranks that held state before. After a grow
the position's first rank then sends the whole re-laid state, sealed like a
snapshot, to every rank of the position, the new ones included.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist
from megatron.training.checkpointing import inner_optimizers

from deadpool_ext import snapshot as snap


@dataclass
class Bucket:
    numel: int                    # the whole bucket, padding included
    params: Dict[str, tuple]      # name -> (start in the bucket, numel)


def buckets(model, optimizer) -> List[Bucket]:
    """The buckets in snapshot order, with each parameter's place by name."""
    names = {param: name for chunk in model for name, param in chunk.named_parameters()}
    result = []
    for opt in inner_optimizers(optimizer):
        for gbuf_index, per_dtype in enumerate(opt.gbuf_ranges):
            buffer = opt.buffers[gbuf_index]
            for bucket_list in per_dtype.values():
                for bucket_index, _ in enumerate(bucket_list):
                    bucket = buffer.buckets[bucket_index]
                    places = {}
                    for param in bucket.params_list:
                        start, end, _ = buffer.param_index_map[param]
                        places[names[param]] = (start - bucket.offset, end - start)
                    result.append(Bucket(bucket.grad_data.numel(), places))
    return result


def full_state(layout_buckets: List[Bucket], shards: List[List[torch.Tensor]]
               ) -> Dict[str, List[torch.Tensor]]:
    """Per parameter name, its flat (param, exp_avg, exp_avg_sq) from the
    state regions of every DP rank's snapshot (``shards[k]``, in DP order)."""
    dp = len(shards)
    state: Dict[str, List[torch.Tensor]] = {}
    base = 0
    for bucket in layout_buckets:
        size = bucket.numel // dp
        for region in range(len(snap.STATES)):
            flat = torch.cat([shards[k][region][base:base + size] for k in range(dp)])
            for name, (start, numel) in bucket.params.items():
                state.setdefault(name, [None] * len(snap.STATES))[region] = \
                    flat[start:start + numel].clone()
        base += size
    return state


def flat_state(layout_buckets: List[Bucket], state: Dict[str, List[torch.Tensor]]
               ) -> torch.Tensor:
    """(3, total numel): every bucket's full flat state, buckets in order,
    each parameter at its place in the (new) buckets, padding zero."""
    flats = torch.zeros(len(snap.STATES), sum(b.numel for b in layout_buckets))
    base = 0
    for bucket in layout_buckets:
        for name, (start, numel) in bucket.params.items():
            for region in range(len(snap.STATES)):
                flats[region, base + start:base + start + numel] = state[name][region]
        base += bucket.numel
    return flats


def shard_of(layout_buckets: List[Bucket], flats: torch.Tensor, dp_rank: int,
             dp_size: int) -> List[torch.Tensor]:
    """This DP rank's state regions: its slice of every bucket."""
    parts, base = [], 0
    for bucket in layout_buckets:
        size = bucket.numel // dp_size
        parts.append(flats[:, base + dp_rank * size:base + (dp_rank + 1) * size])
        base += bucket.numel
    whole = torch.cat(parts, dim=1)
    return [whole[region].clone() for region in range(len(snap.STATES))]


def new_shard(layout_buckets: List[Bucket], state: Dict[str, List[torch.Tensor]],
              dp_rank: int, dp_size: int) -> List[torch.Tensor]:
    """This DP rank's state regions under the new buckets."""
    return shard_of(layout_buckets, flat_state(layout_buckets, state), dp_rank, dp_size)


def position_groups(grid, holders: Set[int]) -> Tuple[Optional[object], object]:
    """Gloo groups of this rank's (tp, pp) position in ``grid`` (the new
    world): its ranks that held state before, and all of them. Collective:
    every rank creates every position's groups, in the same order."""
    me = dist.get_rank()
    mine_holders, mine_all = None, None
    for pp in range(grid.pp):
        for tp in range(grid.tp):
            ranks = [grid.rank(tp, d, pp) for d in range(grid.dp)]
            kept = [r for r in ranks if r in holders]
            group = dist.new_group(ranks, backend="gloo")
            kept_group = group if kept == ranks else dist.new_group(kept, backend="gloo")
            if me in ranks:
                mine_all = group
                mine_holders = kept_group if me in kept else None
    return mine_holders, mine_all


def share_position(layout: snap.ShardLayout, flats: Optional[torch.Tensor],
                   sidecar: Optional[dict], iteration: int, root: int,
                   group) -> Tuple[torch.Tensor, dict]:
    """The root's full state and sidecar on every rank of the position,
    sealed and verified like a snapshot. ``layout``: this rank's new shard
    layout (its sidecar room is the same on every rank of the position)."""
    whole = snap.ShardLayout([], flats.shape[1] if flats is not None else 0,
                             layout.sidecar_capacity)
    size = torch.tensor([whole.numel], dtype=torch.int64)
    dist.broadcast(size, root, group=group)
    whole.numel = int(size.item())
    buffer = snap.allocate(whole)
    if dist.get_rank() == root:
        for view, values in zip(snap.regions(buffer, whole), flats):
            view.copy_(values)
        # One Adam step for all: the receivers' segments differ from the root's.
        steps = sorted(set(sidecar["steps"]))[:1]
        snap.seal(buffer, whole, iteration, root,
                  snap.encode_sidecar(dict(sidecar, steps=steps)))
    dist.broadcast(buffer, root, group=group)
    snap.verify(buffer, whole, iteration=iteration, owner=root)
    return torch.stack(snap.regions(buffer, whole)), snap.read_sidecar(buffer, whole)


def gather_position(old_layout: snap.ShardLayout, own: Dict[int, torch.Tensor],
                    sources: Dict[int, List], old_ring: List[int], renumber: Dict[int, int],
                    iteration: int, group) -> List[torch.Tensor]:
    """Every old snapshot of this position, in old DP order, on every rank
    of ``group`` (the position's holders): broadcast by its contributor,
    verified on arrival. ``own``: old rank -> buffer this process contributes."""
    buffers = []
    for old_rank in old_ring:
        contributor = renumber[sources[old_rank][0]]
        buffer = own.get(old_rank)
        if buffer is None:
            buffer = snap.allocate(old_layout)
        else:
            buffer = buffer.to("cpu", copy=True)  # device-memory mirrors too
        dist.broadcast(buffer, contributor, group=group)
        snap.verify(buffer, old_layout, iteration=iteration, owner=old_rank)
        buffers.append(buffer)
    return buffers


def build_snapshot(layout: snap.ShardLayout, regions: List[torch.Tensor], sidecar: dict,
                   iteration: int, owner: int) -> torch.Tensor:
    """A sealed snapshot of the new layout, ready for ``restore_snapshot``."""
    buffer = snap.allocate(layout)
    for view, values in zip(snap.regions(buffer, layout), regions):
        if values.numel() != view.numel():
            raise snap.SnapshotError(f"re-sharded state has {values.numel()} elements, the "
                                     f"new layout {view.numel()}")
        view.copy_(values)
    steps = sorted(set(sidecar["steps"]))
    if len(steps) > 1:
        raise snap.SnapshotError(f"Adam steps differ between parameters: {steps}")
    sidecar = dict(sidecar, steps=steps * len(layout.segments))
    snap.seal(buffer, layout, iteration, owner, snap.encode_sidecar(sidecar))
    return buffer
