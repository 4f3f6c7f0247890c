"""--check-weight-hash-across-dp-replicas-interval: the parameters' hashes across DP replicas.

As Megatron-LM: at the start and after every interval-th step, each
parameter's hash against the other data-parallel replicas' (megatron-core's
check). A difference is corruption, and the run stops. A hook, so that an
extension can check elsewhere in the iteration or act otherwise on a
difference (deadpool's ``rank/sdc.py`` checks every iteration and redoes it
from memory)."""

import contextlib
from typing import TYPE_CHECKING, List

import torch.distributed as dist

from megatron.core.utils import check_param_hashes_across_dp_replicas
from megatron.training.config import Config
from megatron.training.hooks import Hook

if TYPE_CHECKING:
    from megatron.training.training import Trainer


class ReplicaHashCheck(Hook):
    def __init__(self, interval: int):
        self.interval = interval

    def on_setup(self, trainer: "Trainer") -> None:
        self.check(trainer)

    def after_step(self, trainer: "Trainer", metrics: dict) -> None:
        if trainer.progress.iteration % self.interval == 0:
            self.check(trainer)

    def check(self, trainer: "Trainer") -> None:
        it = trainer.progress.iteration
        with parameters_gathered(trainer):
            same = self.replicas_agree(trainer)
        if not same:
            raise RuntimeError(
                f"parameter hashes differ between data-parallel replicas after iteration {it}"
            )
        dist.barrier()
        if trainer.runtime.rank == 0:
            print(f">>> Weight hashes match after {it} iterations...", flush=True)

    def replicas_agree(self, trainer: "Trainer") -> bool:
        return check_param_hashes_across_dp_replicas(trainer.state.model, cross_check=True)


@contextlib.contextmanager
def parameters_gathered(trainer: "Trainer"):
    """With --overlap-param-gather the step's all-gather ends in the next
    forward: disabling the pre-hook finishes it first (as Megatron-LM)."""
    overlapped = trainer.config.parallel.overlap_param_gather
    if overlapped:
        for chunk in trainer.state.model:
            chunk.disable_forward_pre_hook()
    try:
        yield
    finally:
        if overlapped:
            for chunk in trainer.state.model:
                chunk.enable_forward_pre_hook()


def replica_check_hooks(config: Config, hooks: List[Hook]) -> List[Hook]:
    """Megatron-LM's check, unless the flag is off or an extension's hook
    checks the replicas in its place."""
    interval = config.training.check_weight_hash_across_dp_replicas_interval
    if interval is None or any(isinstance(h, ReplicaHashCheck) for h in hooks):
        return []
    return [ReplicaHashCheck(interval)]
