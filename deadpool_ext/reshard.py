"""Re-shard the distributed optimizer's state onto a different DP size.

A snapshot's shard for DP rank k is, bucket by bucket, the slice
[k*S, (k+1)*S) of the bucket's flat buffer (S = bucket numel / DP), and
buckets follow each other in the optimizers' order (``snapshot.build_layout``).
So the DP snapshots of one (tp, pp) position, side by side, give every
bucket's full flat state; each parameter's state is cut out of it by its
place in the old buffers and put at its place in the new ones, whose padding
and shard bounds depend on the new DP size. Parameters are matched by name.

The exchange: every old snapshot of a position is broadcast, checksum
verified, from the kept rank that contributes it (``shrink.shard_sources``)
over the new data-parallel group of that position.
"""

from dataclasses import dataclass
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state

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


def new_shard(layout_buckets: List[Bucket], state: Dict[str, List[torch.Tensor]],
              dp_rank: int, dp_size: int) -> List[torch.Tensor]:
    """This DP rank's state regions under the new buckets."""
    regions = [[] for _ in snap.STATES]
    for bucket in layout_buckets:
        size = bucket.numel // dp_size
        for region in range(len(snap.STATES)):
            flat = torch.zeros(bucket.numel, dtype=torch.float32)
            for name, (start, numel) in bucket.params.items():
                flat[start:start + numel] = state[name][region]
            regions[region].append(flat[dp_rank * size:(dp_rank + 1) * size])
    return [torch.cat(parts) for parts in regions]


def gather_position(old_layout: snap.ShardLayout, own: Dict[int, torch.Tensor],
                    sources: Dict[int, List], old_ring: List[int], renumber: Dict[int, int],
                    iteration: int) -> List[torch.Tensor]:
    """Every old snapshot of this position, in old DP order, on every rank
    of the new DP group: broadcast by its contributor, verified on arrival.
    ``own``: old rank -> buffer this process contributes."""
    group = parallel_state.get_data_parallel_group()
    buffers = []
    for old_rank in old_ring:
        contributor = renumber[sources[old_rank][0]]
        buffer = own.get(old_rank)
        if buffer is None:
            buffer = snap.allocate(old_layout)
        else:
            buffer = buffer.clone()
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
