"""The trainer's hook points: what an extension (deadpool's recovery, CUDA
graphs) overrides to run inside an iteration without the trainer knowing it."""

from typing import TYPE_CHECKING, List

import torch

from megatron.training import saving

if TYPE_CHECKING:
    from megatron.training.training import Trainer


class Hook:
    """Override what you need; every method is optional. In the order the
    trainer calls them within an iteration: before_step, then per training
    microbatch before_microbatch and after_forward (its output, which a hook
    may register a backward hook on), before_grad_reduce (at the end of
    backward), before_optimizer_step, before_param_sync (after the optimizer
    updated the shard, before the parameter all-gather), after_step. Around
    a checkpoint save: before_save, and after_save with its outcome once it
    ended (for --async-save, iterations later)."""

    def on_setup(self, trainer: "Trainer") -> None: ...
    def before_step(self, trainer: "Trainer") -> None: ...
    def before_microbatch(self, trainer: "Trainer") -> None: ...
    def after_forward(self, trainer: "Trainer", output: torch.Tensor) -> None: ...
    def before_grad_reduce(self, trainer: "Trainer") -> None: ...
    def before_optimizer_step(self, trainer: "Trainer") -> None: ...
    def before_param_sync(self, trainer: "Trainer") -> None: ...
    def after_step(self, trainer: "Trainer", metrics: dict) -> None: ...
    def before_save(self, trainer: "Trainer") -> None: ...
    def after_save(self, trainer: "Trainer", outcome: saving.Outcome) -> None: ...
    def log_fields(self, trainer: "Trainer") -> List[str]:
        return []

    def on_train_end(self, trainer: "Trainer") -> None: ...
