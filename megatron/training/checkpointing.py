"""Per-rank checkpoints: model shard, optimizer shard, scheduler, RNG,
iteration and consumed samples, so a resumed run continues the same curve.

Layout: ``{dir}/iter_{iteration:07d}/tp{TP:02d}_pp{PP:03d}_dp{DP:03d}.pt`` and
``{dir}/latest_checkpointed_iteration.txt``, written last and atomically, so a
checkpoint that was cut off half-way is never picked up. Files hold tensors
and plain containers only and are loaded with ``weights_only=True``.
"""

import os
import random
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron.training import optimizer_layout
from megatron.training.optimizer_layout import inner_optimizers

TRACKER = "latest_checkpointed_iteration.txt"


def optimizer_shard(optimizer) -> List[Dict[str, torch.Tensor]]:
    """This rank's optimizer state, one dict per main parameter, in the
    optimizer's own (deterministic) parameter order: the fp32 main parameter
    and its state (Adam's step, exp_avg, exp_avg_sq). With the distributed
    optimizer these are the rank's shard only."""
    entries = []
    for opt in inner_optimizers(optimizer):
        torch_opt = opt.optimizer
        for group in torch_opt.param_groups:
            for param in group["params"]:
                entries.append({"param": param.data, **torch_opt.state.get(param, {})})
    return entries


def load_optimizer_shard(optimizer, entries: List[Dict[str, torch.Tensor]]) -> None:
    """Copy a saved shard into this rank's optimizer, in place (main params
    may be views of the model's buffers), creating Adam state if missing."""
    params = [
        p
        for opt in inner_optimizers(optimizer)
        for g in opt.optimizer.param_groups
        for p in g["params"]
    ]
    if len(params) != len(entries):
        raise RuntimeError(
            f"optimizer shard has {len(entries)} parameters, this rank "
            f"has {len(params)}: the checkpoint is from another model or layout"
        )
    states = [
        opt.optimizer.state
        for opt in inner_optimizers(optimizer)
        for g in opt.optimizer.param_groups
        for _ in g["params"]
    ]
    for param, state, entry in zip(params, states, entries):
        param.data.copy_(entry["param"].view_as(param))
        for key, value in entry.items():
            if key == "param":
                continue
            if key in state[param]:
                state[param][key].copy_(value.view_as(state[param][key]))
            elif key == "step":
                state[param][key] = value.clone()  # torch keeps Adam's step on the host
            else:
                state[param][key] = value.view_as(param).to(param.device, copy=True)


def schedule_state(state) -> dict:
    """The LR scheduler and the grad scaler (None without one)."""
    scaler = getattr(state.optimizer, "grad_scaler", None)
    return {
        "scheduler": state.scheduler.state_dict(),
        "grad_scaler": scaler.state_dict() if scaler is not None else None,
    }


def load_schedule_state(state, saved: dict) -> None:
    scaler = getattr(state.optimizer, "grad_scaler", None)
    if scaler is not None and saved["grad_scaler"] is not None:
        scaler.load_state_dict(saved["grad_scaler"])
    # load_state_dict adds the saved step count to the current one.
    state.scheduler.num_steps = 0
    state.scheduler.load_state_dict(saved["scheduler"])


def rng_state() -> dict:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.copy()), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy(), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def layout() -> dict:
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size(),
        "pp": parallel_state.get_pipeline_model_parallel_world_size(),
        "dp": parallel_state.get_data_parallel_world_size(),
    }


def rank_file(directory: str, iteration: int) -> str:
    name = "tp{:02d}_pp{:03d}_dp{:03d}.pt".format(
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )
    return os.path.join(directory, f"iter_{iteration:07d}", name)


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(directory: str, iteration: int, consumed_samples: int, state) -> str:
    """Every rank writes its file; rank 0 then points the tracker at it."""
    path = rank_file(directory, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _atomic_save(
        {
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "layout": layout(),
            "model": state.model[0].state_dict(),
            "optimizer": optimizer_shard(state.optimizer),
            **shard_layout(state),
            **schedule_state(state),
            "rng": rng_state(),
        },
        path,
    )
    dist.barrier()
    if dist.get_rank() == 0:
        tracker = os.path.join(directory, TRACKER)
        with open(tracker + ".tmp", "w") as f:
            f.write(str(iteration))
        os.replace(tracker + ".tmp", tracker)
    dist.barrier()
    return path


def latest_iteration(directory: str) -> Optional[int]:
    tracker = os.path.join(directory, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        return int(f.read().strip())


def shard_layout(state) -> dict:
    """With the distributed optimizer: where the shard's entries sit in the
    buckets, so that a run with another data-parallel size can load it."""
    if not optimizer_layout.is_distributed(state.optimizer):
        return {}
    return {
        "shard_places": [
            list(place) for place in optimizer_layout.shard_places(state.model, state.optimizer)
        ],
        "buckets": optimizer_layout.table(optimizer_layout.buckets(state.model, state.optimizer)),
    }


def load_checkpoint(
    directory: str, state, load_optim: bool = True, load_rng: bool = True, finetune: bool = False
) -> Optional[dict]:
    """Restore this rank's state; returns {'iteration', 'consumed_samples'} or
    None when there is no checkpoint. A checkpoint of another data-parallel
    size is re-sharded (same TP and PP, distributed optimizer)."""
    iteration = latest_iteration(directory)
    if iteration is None:
        return None
    path = rank_file(directory, iteration)
    if not os.path.exists(path):
        saved = _any_rank_file(directory, iteration)
        if saved["layout"] == layout():
            raise RuntimeError(f"checkpoint {directory} has no file {path}: it is incomplete")
    else:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    resharded = saved["layout"]["dp"] != layout()["dp"]
    if {k: v for k, v in saved["layout"].items() if k != "dp"} != {
        k: v for k, v in layout().items() if k != "dp"
    }:
        raise RuntimeError(
            f"checkpoint {directory} was saved with layout {saved['layout']}, "
            f"this run has {layout()}: resume with the same TP and PP (the "
            "data-parallel size may differ)"
        )
    if resharded:
        saved = _resharded(directory, iteration, saved["layout"]["dp"], state, load_optim)
    state.model[0].load_state_dict(saved["model"], strict=True)
    if finetune:
        return {"iteration": 0, "consumed_samples": 0}
    if load_optim:
        load_optimizer_shard(state.optimizer, saved["optimizer"])
        load_schedule_state(state, saved)
    if load_rng:
        set_rng_state(saved["rng"])
    return {"iteration": saved["iteration"], "consumed_samples": saved["consumed_samples"]}


def _position_file(directory: str, iteration: int, dp_rank: int) -> str:
    return os.path.join(
        directory,
        f"iter_{iteration:07d}",
        "tp{:02d}_pp{:03d}_dp{:03d}.pt".format(
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            dp_rank,
        ),
    )


def _any_rank_file(directory: str, iteration: int) -> dict:
    """The first data-parallel rank's file of this rank's position."""
    path = _position_file(directory, iteration, 0)
    if not os.path.exists(path):
        raise RuntimeError(
            f"checkpoint {directory} has no file {path}: it is incomplete or "
            "from another TP/PP layout"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def _resharded(directory: str, iteration: int, old_dp: int, state, load_optim: bool) -> dict:
    """This rank's file as if it had been saved with this run's data-parallel
    size: the model and schedule are the same on every DP rank; the RNG
    comes from DP rank (this rank mod the old size), since DP peers draw
    alike; the optimizer shard is cut anew from all old shards of this
    position."""
    dp_rank, dp = parallel_state.get_data_parallel_rank(), layout()["dp"]
    files = [
        torch.load(_position_file(directory, iteration, k), map_location="cpu", weights_only=True)
        for k in range(old_dp)
    ]
    saved = dict(files[dp_rank % old_dp])
    if not load_optim:
        return saved
    if "shard_places" not in saved or not optimizer_layout.is_distributed(state.optimizer):
        raise RuntimeError(
            f"checkpoint {directory} was saved with data-parallel size {old_dp}, "
            f"this run has {dp}: a different size needs the distributed "
            "optimizer (--use-distributed-optimizer) on both sides"
        )
    by_name = optimizer_layout.full_state(
        optimizer_layout.from_table(saved["buckets"]), [_regions(f) for f in files]
    )
    regions = optimizer_layout.new_shard(
        optimizer_layout.buckets(state.model, state.optimizer), by_name, dp_rank, dp
    )
    steps = {float(e["step"]) for f in files for e in f["optimizer"] if "step" in e}
    if len(steps) > 1:
        raise RuntimeError(
            f"checkpoint {directory}: Adam's step differs between parameters ({sorted(steps)})"
        )
    saved["optimizer"] = [
        _entry(regions, offset, numel, steps)
        for _, offset, numel in optimizer_layout.shard_places(state.model, state.optimizer)
    ]
    return saved


def _regions(saved: dict) -> List[torch.Tensor]:
    """A saved shard as flat (param, exp_avg, exp_avg_sq) regions."""
    numel = sum(bucket_numel // saved["layout"]["dp"] for bucket_numel, _ in saved["buckets"])
    regions = [torch.zeros(numel) for _ in optimizer_layout.REGIONS]
    for entry, (_, offset, n) in zip(saved["optimizer"], saved["shard_places"]):
        for region, key in zip(regions, optimizer_layout.REGIONS):
            if key in entry:
                region[offset : offset + n] = entry[key].reshape(-1)
    return regions


def _entry(regions: List[torch.Tensor], offset: int, numel: int, steps: set) -> dict:
    entry = {"param": regions[0][offset : offset + numel]}
    if steps:  # no Adam state before the first step
        entry.update(
            exp_avg=regions[1][offset : offset + numel],
            exp_avg_sq=regions[2][offset : offset + numel],
            step=torch.tensor(next(iter(steps))),
        )
    return entry
