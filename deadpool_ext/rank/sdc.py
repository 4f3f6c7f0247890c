"""Silent data corruption, caught where two copies must agree.

``ReplicaDigestCheck`` is Megatron-LM's
--check-weight-hash-across-dp-replicas-interval under --deadpool (every
iteration unless the flag says otherwise): at the start of an iteration,
before its forward reads them, one 64-bit digest of each of this rank's
parameter buffers is compared with the other data-parallel replicas' (8
bytes per buffer travel, not a hash per parameter). A difference names the
replicas that disagree with the majority (both, with two replicas) and
raises ``SilentCorruption``: the recovery rolls every rank back to the
iteration's start from its in-memory snapshot (--deadpool-on-sdc).

What it sees: a flip in a parameter of one replica between the step's
all-gather and the next forward (memory at rest, a bad copy). What it
cannot: a flip in a gradient before its reduction, in an activation, or in
the shard's update itself reaches every replica alike through the
all-gather (the buddy's replay in --deadpool-mirror-mode grad checks the
update: ``state/mirror.py``).
"""

from collections import defaultdict
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron.training.replica_check import ReplicaHashCheck, parameters_gathered
from megatron.training.training import Trainer

from deadpool_ext.state.digest import (
    SilentCorruption,
    odd_ones_out,
    signed64,
    tensor_digest,
    unsigned64,
)

CHECK = "weight-hash"


def ddp_buffers(model: list) -> list:
    """megatron-core's parameter-and-gradient buffers of every model chunk,
    experts' too (their data-parallel group is the expert one)."""
    return [b for chunk in model for b in chunk.buffers + chunk.expert_parallel_buffers]


def parameter_buffers(model: list) -> List[Tuple[torch.Tensor, object]]:
    """(flat parameters, the data-parallel group that holds them alike) of
    each buffer."""
    return [(b.param_data, b.data_parallel_group) for b in ddp_buffers(model)]


class ReplicaDigestCheck(ReplicaHashCheck):
    def on_setup(self, trainer: Trainer) -> None:
        """The first iteration's start checks: nothing to do at set-up."""

    def after_step(self, trainer: Trainer, metrics: dict) -> None:
        """Checked at the next iteration's start instead."""

    def before_step(self, trainer: Trainer) -> None:
        if trainer.progress.iteration % self.interval == 0:
            with parameters_gathered(trainer):
                self.replicas_agree(trainer)

    def replicas_agree(self, trainer: Trainer) -> bool:
        by_group: Dict[object, List[int]] = defaultdict(list)
        for data, group in parameter_buffers(trainer.state.model):
            by_group[group].append(tensor_digest(data))
        for group, digests in by_group.items():
            self.compare(trainer, group, digests)
        return True

    def compare(self, trainer: Trainer, group, digests: List[int]) -> None:
        """All-gather the group's digests; raise if a replica differs."""
        device = None if trainer.runtime.on_cpu else torch.cuda.current_device()
        mine = torch.tensor([signed64(d) for d in digests], dtype=torch.int64, device=device)
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        for index in range(mine.numel()):
            column = [int(replica[index]) for replica in everyone]
            odd = odd_ones_out(column)
            if odd is None:
                continue
            iteration = trainer.progress.iteration + 1
            raise SilentCorruption(
                CHECK,
                iteration,
                [ranks[i] for i in odd],
                f"parameter buffer {index}'s digests across data-parallel ranks {ranks} are "
                f"{[f'{unsigned64(v):#x}' for v in column]}",
            )
