"""Put a verified snapshot back into live training objects (which may be
freshly built), so training continues the same curve bit for bit.
"""

import torch

from megatron.training import checkpointing
from megatron.training.training import Progress, Trainer

from deadpool_ext import snapshot as snap


def restore_snapshot(trainer: Trainer, layout: snap.ShardLayout, buffer: torch.Tensor) -> int:
    """Collective over data-parallel peers (the parameter all-gather).
    Returns the iteration training resumes at."""
    snap.verify(buffer, layout, owner=trainer.runtime.rank)
    side = snap.read_sidecar(buffer, layout)
    state = trainer.state
    snap.unpack_shard(state.optimizer, layout, buffer, side["steps"])
    # Main params -> model params, then the same all-gather an optimizer step
    # ends with: this also overwrites any half-applied update on the model.
    for opt in checkpointing.inner_optimizers(state.optimizer):
        opt._copy_main_params_to_model_params()
    for chunk in state.model:
        chunk.start_param_sync(force_sync=True)
    # load_state_dict adds the loaded step count to the current one.
    state.scheduler.num_steps = 0
    state.scheduler.load_state_dict(side["scheduler"])
    scaler = getattr(state.optimizer, "grad_scaler", None)
    if scaler is not None and side["grad_scaler"] is not None:
        scaler.load_state_dict(side["grad_scaler"])
    checkpointing.set_rng_state(side["rng"])
    trainer.progress = Progress(**side["progress"])
    trainer.reset_train_iterator()
    return trainer.progress.iteration
