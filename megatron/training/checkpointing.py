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

TRACKER = "latest_checkpointed_iteration.txt"


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers under a ChainedOptimizer (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


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
    params = [p for opt in inner_optimizers(optimizer)
              for g in opt.optimizer.param_groups for p in g["params"]]
    if len(params) != len(entries):
        raise RuntimeError(f"optimizer shard has {len(entries)} parameters, this rank "
                           f"has {len(params)}: the checkpoint is from another model or layout")
    states = [opt.optimizer.state for opt in inner_optimizers(optimizer)
              for g in opt.optimizer.param_groups for _ in g["params"]]
    for param, state, entry in zip(params, states, entries):
        param.data.copy_(entry["param"])
        for key, value in entry.items():
            if key == "param":
                continue
            if key in state[param]:
                state[param][key].copy_(value)
            elif key == "step":
                state[param][key] = value.clone()  # torch keeps Adam's step on the host
            else:
                state[param][key] = value.to(param.device, copy=True)


def schedule_state(state) -> dict:
    """The LR scheduler and the grad scaler (None without one)."""
    scaler = getattr(state.optimizer, "grad_scaler", None)
    return {"scheduler": state.scheduler.state_dict(),
            "grad_scaler": scaler.state_dict() if scaler is not None else None}


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
        parallel_state.get_data_parallel_rank())
    return os.path.join(directory, f"iter_{iteration:07d}", name)


def _atomic_save(obj, path: str) -> None:
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(directory: str, iteration: int, consumed_samples: int, state) -> str:
    """Every rank writes its file; rank 0 then points the tracker at it."""
    path = rank_file(directory, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _atomic_save({
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "layout": layout(),
        "model": state.model[0].state_dict(),
        "optimizer": optimizer_shard(state.optimizer),
        **schedule_state(state),
        "rng": rng_state(),
    }, path)
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


def load_checkpoint(directory: str, state, load_optim: bool = True, load_rng: bool = True,
                    finetune: bool = False) -> Optional[dict]:
    """Restore this rank's state; returns {'iteration', 'consumed_samples'} or
    None when there is no checkpoint."""
    iteration = latest_iteration(directory)
    if iteration is None:
        return None
    saved = torch.load(rank_file(directory, iteration), map_location="cpu", weights_only=True)
    if saved["layout"] != layout():
        raise RuntimeError(f"checkpoint {directory} was saved with layout {saved['layout']}, "
                           f"this run has {layout()}: resume with the same TP/PP/DP")
    state.model[0].load_state_dict(saved["model"], strict=True)
    if finetune:
        return {"iteration": 0, "consumed_samples": 0}
    if load_optim:
        load_optimizer_shard(state.optimizer, saved["optimizer"])
        load_schedule_state(state, saved)
    if load_rng:
        set_rng_state(saved["rng"])
    return {"iteration": saved["iteration"], "consumed_samples": saved["consumed_samples"]}
