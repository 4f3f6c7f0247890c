"""Where the distributed optimizer keeps each parameter's state, and how to
cut that state again for another data-parallel size.

megatron-core's DistributedOptimizer splits every gradient bucket's flat
buffer (padded to a multiple of DP) into DP equal slices; DP rank k owns
slice k of every bucket, buckets following each other in the optimizers'
order. So the DP shards of one (tp, pp) position, side by side, give every
bucket's full flat state, from which each parameter's state is cut by its
place in the bucket and put at its place in the buckets of the new size
(whose padding and slice bounds depend on that size). Parameters are
matched by name. An MoE model's expert buckets (a second distributed
optimizer) are sliced over the expert-data-parallel group instead: their
full state comes from the shards of the ranks holding the same experts.
Used by deadpool's shrink and grow (checkpoints are re-cut by
dist_checkpointing); also the fixes megatron-core's distributed optimizer
needs around a checkpoint: when torch's Adam is used, and where it
describes its state fully reshardable.
"""

import functools
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch

REGIONS = ("param", "exp_avg", "exp_avg_sq")  # the fp32 main parameter and Adam's moments


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers under a ChainedOptimizer (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def steps_per_parameter(torch_opt) -> bool:
    """Where an Adam keeps its step: torch's in each parameter's state;
    Apex's and Transformer Engine's FusedAdam (megatron-core's choice where
    either is installed) one per parameter group, as an int."""
    if isinstance(torch_opt, type):
        return issubclass(torch_opt, (torch.optim.Adam, torch.optim.AdamW))
    return isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW))


def torch_adams(optimizer) -> Iterator[torch.optim.Optimizer]:
    """The torch Adam optimizers megatron-core runs without Apex or Transformer Engine."""
    for opt in inner_optimizers(optimizer):
        torch_opt = getattr(opt, "optimizer", None)
        if isinstance(torch_opt, (torch.optim.Adam, torch.optim.AdamW)):
            yield torch_opt


def init_adam_state(optimizer) -> None:
    """Adam's state as torch creates it before its first step (step 0, zero
    moments) wherever it does not exist yet. Without Apex or Transformer
    Engine, megatron-core's distributed optimizer reads Adam's step from
    this state to describe itself for a checkpoint, and fails on a fresh
    optimizer (one about to load a checkpoint)."""
    for torch_opt in torch_adams(optimizer):
        for group in torch_opt.param_groups:
            for param in group["params"]:
                state = torch_opt.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)


def restore_adam_steps(optimizer) -> None:
    """Adam's step, one tensor per parameter, from the step a loaded
    checkpoint put in each parameter group. Without Apex or Transformer
    Engine, megatron-core's distributed optimizer keeps the step in the
    parameter groups of a checkpoint, but its load then writes the step the
    optimizer had before the load into each parameter's state (and shares
    one tensor among them, which torch's Adam would advance once per
    parameter)."""
    for torch_opt in torch_adams(optimizer):
        for group in torch_opt.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                if param in torch_opt.state:
                    torch_opt.state[param]["step"] = torch.tensor(float(group["step"]))


def patch_reshardable_load() -> None:
    """Without Apex or Transformer Engine (any CPU run, and a GPU without
    them) megatron-core runs torch's Adam, which keeps its step in every
    parameter's state. Loading a distributed
    optimizer saved fully reshardable copies each state entry of a parameter
    from the checkpoint's, which holds no step (megatron-core restores the
    step from the parameter groups), and fails on the key. The step is left
    out of that copy, and kept."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "_deadpool_patched", False):
        return  # once per process

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state.get(main_param, {})
        step = state.pop("step", None) if "step" not in tensors else None
        try:
            original(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    set_states._deadpool_patched = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def patch_reshardable_save() -> None:
    """megatron-core 0.16 describes a distributed optimizer's state fully
    reshardable (saving it, and the description a load fills) from a copy
    of each buffer's state gathered without the buckets' end padding, but
    cuts each parameter's state from that copy at the parameter's place in
    the padded buffer: a parameter in any bucket after the first gets state
    from further on (a tied embedding in its bucket of its own, the buckets
    of --overlap-grad-reduce), and a run resumed from it diverges. While it
    describes the state, each buffer's map of parameter places is swapped
    for the places in the gathered copy."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.sharded_param_state_fully_reshardable
    if getattr(original, "_deadpool_patched", False):
        return  # once per process

    @functools.wraps(original)
    def sharded_state(self, *args, **kwargs):
        padded = [buffer.param_index_map for buffer in self.buffers]
        try:
            for buffer in self.buffers:
                buffer.param_index_map = places_without_bucket_padding(buffer)
            return original(self, *args, **kwargs)
        finally:
            for buffer, index_map in zip(self.buffers, padded):
                buffer.param_index_map = index_map

    sharded_state._deadpool_patched = True
    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_state


def places_without_bucket_padding(buffer) -> dict:
    """Each parameter's (start, end, bucket) in its buffer with the padding
    at the end of every bucket left out (the buckets lie end to end)."""
    shift, unpadded = [], 0
    for bucket in buffer.buckets:
        shift.append(bucket.offset - unpadded)
        unpadded += bucket.numel_unpadded
    return {
        param: (start - shift[bucket], end - shift[bucket], bucket)
        for param, (start, end, bucket) in buffer.param_index_map.items()
    }


@dataclass
class ShardBucket:
    """One gradient bucket as this rank's shard sees it."""

    optimizer_index: int  # among inner_optimizers()
    optimizer: object  # megatron-core's DistributedOptimizer
    buffer: object  # the bucket's _ParamAndGradBuffer
    bucket: object  # megatron-core's bucket
    param_map: dict  # model param -> its ranges; "gbuf_local": its slice of this shard
    shard_start: Optional[int]  # where this bucket's slice starts in the rank's flat shard


def walk_buckets(optimizer, shard_offsets: bool = True) -> Iterator[ShardBucket]:
    """The one walk over the distributed optimizers' buckets, in the order
    of the rank's flat shard (each bucket contributes numel / DP elements).
    Without ``shard_offsets`` it reads no process group (a rank whose groups
    are detached walks its old buckets during a shrink)."""
    shard_start = 0
    for index, opt in enumerate(inner_optimizers(optimizer)):
        dp_size = opt.data_parallel_group.size() if shard_offsets else None
        for gbuf_index, per_dtype in enumerate(opt.gbuf_ranges):
            buffer = opt.buffers[gbuf_index]
            for bucket_list in per_dtype.values():
                for bucket_index, bucket_range in enumerate(bucket_list):
                    bucket = buffer.buckets[bucket_index]
                    yield ShardBucket(
                        index,
                        opt,
                        buffer,
                        bucket,
                        bucket_range["param_map"],
                        shard_start if shard_offsets else None,
                    )
                    if shard_offsets:
                        shard_start += bucket.grad_data.numel() // dp_size


@dataclass
class Bucket:
    numel: int  # the whole bucket, padding included
    params: Dict[str, tuple]  # name -> (start in the bucket, numel)
    expert: bool = False  # an MoE expert's: sliced over expert-DP, not DP


def is_expert(param) -> bool:
    """megatron-core marks expert parameters: not all-reduced over DP."""
    return not getattr(param, "allreduce", True)


def _param_names(model) -> dict:
    """Parameter -> its name; with several model chunks (virtual pipeline
    stages, whose layers are numbered within the chunk) the chunk's
    checkpoint key first, so that names stay unique."""
    if len(model) == 1:
        return {param: name for name, param in model[0].named_parameters()}
    return {
        param: f"model{i}.{name}"
        for i, chunk in enumerate(model)
        for name, param in chunk.named_parameters()
    }


def buckets(model, optimizer) -> List[Bucket]:
    """The buckets in shard order, with each parameter's place by name."""
    names = _param_names(model)
    result = []
    for b in walk_buckets(optimizer, shard_offsets=False):
        places = {}
        for param in b.bucket.params_list:
            start, end, _ = b.buffer.param_index_map[param]
            places[names[param]] = (start - b.bucket.offset, end - start)
        expert = any(is_expert(param) for param in b.bucket.params_list)
        result.append(Bucket(b.bucket.grad_data.numel(), places, expert))
    return result


def full_state(
    layout_buckets: List[Bucket],
    shards: List[List[torch.Tensor]],
    expert_shards: Optional[List[List[torch.Tensor]]] = None,
) -> Dict[str, List[torch.Tensor]]:
    """Per parameter name, its flat (param, exp_avg, exp_avg_sq) from the
    regions of every DP rank's shard (``shards[k]``, in DP order); expert
    buckets from those of the expert-DP group (``expert_shards``, in its
    order)."""
    state: Dict[str, List[torch.Tensor]] = {}
    base = 0
    for bucket in layout_buckets:
        parts = expert_shards if bucket.expert else shards
        size = bucket.numel // len(parts)
        for region in range(len(REGIONS)):
            flat = torch.cat([part[region][base : base + size] for part in parts])
            for name, (start, numel) in bucket.params.items():
                state.setdefault(name, [None] * len(REGIONS))[region] = flat[
                    start : start + numel
                ].clone()
        base += size
    return state


def flat_state(layout_buckets: List[Bucket], state: Dict[str, List[torch.Tensor]]) -> torch.Tensor:
    """(3, total numel): every bucket's full flat state, buckets in order,
    each parameter at its place in the (new) buckets, padding zero."""
    flats = torch.zeros(len(REGIONS), sum(b.numel for b in layout_buckets))
    base = 0
    for bucket in layout_buckets:
        for name, (start, numel) in bucket.params.items():
            for region in range(len(REGIONS)):
                flats[region, base + start : base + start + numel] = state[name][region]
        base += bucket.numel
    return flats


def shard_of(
    layout_buckets: List[Bucket],
    flats: torch.Tensor,
    dp_rank: int,
    dp_size: int,
    expert_slice: Optional[tuple] = None,
) -> List[torch.Tensor]:
    """This DP rank's regions: its slice of every bucket (of an expert
    bucket, the slice ``expert_slice`` = (expert-DP rank, expert-DP size))."""
    parts, base = [], 0
    for bucket in layout_buckets:
        rank, slices = expert_slice if bucket.expert else (dp_rank, dp_size)
        size = bucket.numel // slices
        parts.append(flats[:, base + rank * size : base + (rank + 1) * size])
        base += bucket.numel
    whole = torch.cat(parts, dim=1)
    return [whole[region].clone() for region in range(len(REGIONS))]


def new_shard(
    layout_buckets: List[Bucket],
    state: Dict[str, List[torch.Tensor]],
    dp_rank: int,
    dp_size: int,
    expert_slice: Optional[tuple] = None,
) -> List[torch.Tensor]:
    """This DP rank's regions under the new buckets."""
    flats = flat_state(layout_buckets, state)
    return shard_of(layout_buckets, flats, dp_rank, dp_size, expert_slice)
