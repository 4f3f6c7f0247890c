"""A rank's training state beyond its parameters and optimizer tensors, as plain containers.

The scheduler, the grad scaler, every RNG and the model's persistent
buffers (MoE routers' expert biases), as plain tensors and containers.
DeadPool's in-memory snapshots carry them beside the optimizer shard;
checkpoints on disk hold the same in Megatron-LM's own keys
(``checkpointing.py``)."""

import random

import numpy as np
import torch
from megatron.core import tensor_parallel


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
    load_scheduler(state.scheduler, saved["scheduler"])


def load_scheduler(scheduler, saved: dict) -> None:
    # load_state_dict adds the saved step count to the current one.
    scheduler.num_steps = 0
    scheduler.load_state_dict(saved)


def model_buffers(state) -> list:
    """Each model chunk's persistent buffers, on the host: what the model
    holds beside its parameters and updates itself (an MoE router's expert
    bias moves after every iteration), by name."""
    return [
        {name: buffer.detach().cpu().clone() for name, buffer in _persistent_buffers(chunk)}
        for chunk in state.model
    ]


def load_model_buffers(state, saved: list) -> None:
    """The buffers back; the per-iteration counters that go with them (the
    routers' token counts of an iteration stopped midway) emptied."""
    from megatron.core.distributed.finalize_model_grads import reset_model_temporary_tensors

    for chunk, buffers in zip(state.model, saved):
        own = dict(_persistent_buffers(chunk))
        for name, value in buffers.items():
            own[name].copy_(value)
    reset_model_temporary_tensors(state.tf_config, state.model)


def _persistent_buffers(module):
    for prefix, sub in module.named_modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), buffer


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
