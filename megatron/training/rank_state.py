"""The parts of a rank's training state that are neither model nor optimizer
tensors: the scheduler, the grad scaler and every RNG, as plain tensors and
containers. DeadPool's in-memory snapshots carry them beside the optimizer
shard; checkpoints on disk hold the same in Megatron-LM's own keys
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
