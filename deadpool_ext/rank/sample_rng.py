"""Random draws that follow the sample (--deadpool-sample-rng, on by
default under --deadpool): before each training microbatch's forward, the
random streams that megatron-core draws dropout (and the MoE router's input
jitter) from are seeded from the run's seed, the microbatch's first sample,
its pipeline stage and its model chunk. megatron-core then derives each
tensor-parallel and expert-parallel rank's stream from that seed as it does
from the run's seed, and the layers draw in their order on the stage.

Megatron-LM seeds each rank once, so a microbatch's masks depend on which
data-parallel rank runs it and on what that rank ran before: a shrink, a
grow or a resume at another data-parallel size moves microbatches to other
ranks and changes their masks. Keyed by the sample, a moved microbatch
draws what it drew where it was; the curve then differs only by the order
in which the replicas' gradients are summed. Nothing else of the model
changes: on a fixed layout the run is as reproducible as before.

Limits: torch's host generator (a CPU run's only one) keeps 32 bits of a
seed, so among about 10^5 microbatches two may share masks, which changes
nothing but that. CUDA graphs are refused under --deadpool; with their
graph-safe streams megatron-core would make new generator objects at each
reseed, which captured graphs do not read: keying them would mean seeding
the captured generators in place."""

import hashlib
from typing import TYPE_CHECKING

import torch
from megatron.core import parallel_state

from megatron.training.config import Config
from megatron.training.hooks import Hook
from megatron.training.initialize import seed_model_parallel_streams

if TYPE_CHECKING:
    from megatron.training.training import Trainer

# Below 2**62: megatron-core adds its per-rank offsets to the seed, and
# torch takes seeds below 2**64.
SEED_BITS = 62


def sample_seed(seed: int, first_sample: int, pipeline_rank: int, chunk: int) -> int:
    """The seed of a microbatch's draws on one model chunk of one pipeline
    stage (the same on every data-parallel rank, different for any other
    microbatch, stage or chunk)."""
    key = f"{seed}:{first_sample}:{pipeline_rank}:{chunk}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


class SampleRngHook(Hook):
    def __init__(self, config: Config):
        self.seed = config.training.seed
        self.gpu = config.gpu

    def before_microbatch(self, trainer: "Trainer") -> None:
        position = trainer.microbatch
        if position is None:  # validation: no dropout
            return
        stage = parallel_state.get_pipeline_model_parallel_rank()
        seed = sample_seed(self.seed, position.first_sample, stage, position.chunk)
        # The host's generator; megatron-core seeds the device's (its default
        # stream) and its tracker's. Not torch.manual_seed, which also makes
        # lazy calls for every other kind of device (0.3 ms each time).
        torch.default_generator.manual_seed(seed)
        seed_model_parallel_streams(seed, self.gpu)
