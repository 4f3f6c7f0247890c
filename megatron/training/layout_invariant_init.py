"""Initialisation that does not depend on the parallel layout.

Megatron's own initialisation draws each rank's shard from that rank's RNG
stream, so a TP=2 or PP=2 model starts from other weights than the
single-process model, and their losses cannot be compared. With
``--layout-invariant-init`` every parameter's *full* tensor is drawn from a
generator seeded by (seed, the parameter's global name) and each rank keeps
its tensor-parallel slice: any TP/PP/DP layout starts from the same model.
It costs one full-tensor draw per parameter on every rank, so it is meant
for verification and small models.
"""

import math
import re
import zlib

import torch
from megatron.core import parallel_state

_LAYER = re.compile(r"(decoder\.layers\.)(\d+)(\.)")
# Output projections get megatron's scaled init (std / sqrt(2 * layers)).
_SCALED = ("linear_proj.weight", "linear_fc2.weight")


def global_name(local_name: str, pp_rank: int, layers_per_stage: int, tied: bool) -> str:
    """The name the parameter has in the single-process model."""
    if tied and local_name == "output_layer.weight":
        # The last stage's copy of the tied embedding.
        return "embedding.word_embeddings.weight"
    offset = pp_rank * layers_per_stage
    return _LAYER.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", local_name)


def tp_slice(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int, gated: bool) -> torch.Tensor:
    """This TP rank's slice of a full tensor. A gated (SwiGLU) fc1 holds
    [gate; up] and each rank keeps its slice of both halves."""
    if gated:
        return torch.cat(
            [tp_slice(half, dim, tp_rank, tp_size, False) for half in full.chunk(2, dim=dim)],
            dim=dim,
        )
    size = full.shape[dim] // tp_size
    return full.narrow(dim, tp_rank * size, size)


def _full_shape(param: torch.nn.Parameter, tp_size: int):
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


def _std(name: str, std: float, num_layers: int) -> float:
    return std / math.sqrt(2.0 * num_layers) if name.endswith(_SCALED) else std


@torch.no_grad()
def apply(
    module: torch.nn.Module, seed: int, init_std: float, num_layers: int, tied: bool, gated: bool
) -> None:
    """Redraw every randomly initialised parameter of this rank's stage.

    Constant parameters (zero biases, unit norm weights) are already
    layout-invariant and are left as they are.
    """
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    for local, param in module.named_parameters():
        flat = param.detach().view(-1)
        if flat.numel() == 0 or bool((flat == flat[0]).all()):
            continue
        name = global_name(local, pp_rank, num_layers // pp_size, tied)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(_full_shape(param, tp_size), dtype=torch.float32, device="cpu")
        full.normal_(0.0, _std(name, init_std, num_layers), generator=generator)
        if getattr(param, "tensor_model_parallel", False):
            is_gated_fc1 = gated and name.endswith("linear_fc1.weight")
            full = tp_slice(full, param.partition_dim, tp_rank, tp_size, is_gated_fc1)
        param.copy_(full.to(param.dtype))
