"""Put a verified snapshot back into live training objects (which may be
freshly built), so training continues the same curve bit for bit.
"""

import torch

from megatron.training import checkpointing
from megatron.training.training import Progress, Trainer

from deadpool_ext import snapshot as snap


def restore_snapshot(trainer: Trainer, layout: snap.ShardLayout, buffer: torch.Tensor,
                     iteration=None) -> int:
    """Collective over data-parallel peers (the parameter all-gather).
    Returns the iteration training resumes at."""
    snap.verify(buffer, layout, iteration=iteration, owner=trainer.runtime.rank)
    side = snap.read_sidecar(buffer, layout)
    state = trainer.state
    snap.unpack_shard(state.optimizer, layout, buffer, side["steps"])
    # Main params -> model params, then the same all-gather an optimizer step
    # ends with: this also overwrites any half-applied update on the model.
    for opt in checkpointing.inner_optimizers(state.optimizer):
        opt._copy_main_params_to_model_params()
    for chunk in state.model:
        chunk.start_param_sync(force_sync=True)
    checkpointing.load_schedule_state(state, side)
    checkpointing.set_rng_state(side["rng"])
    trainer.progress = Progress(**side["progress"])
    trainer.reset_train_iterator()
    return trainer.progress.iteration
