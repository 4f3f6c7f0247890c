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
_LOCAL_EXPERT = re.compile(r"(\.local_experts\.)(\d+)(\.)")
# Output projections get megatron's scaled init (std / sqrt(2 * layers)).
_SCALED = ("linear_proj.weight", "linear_fc2.weight")


def _shift(pattern: re.Pattern, name: str, offset: int) -> str:
    return pattern.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}", name)


def global_name(local_name: str, layer_offset: int, tied: bool, expert_offset: int = 0) -> str:
    """The name the parameter has in the single-process model: a module's
    local layer k is layer ``layer_offset + k`` (megatron-core's offset of
    its pipeline stage, or of its virtual stage), and an expert-parallel
    rank's local expert k is expert ``expert_offset + k``."""
    if tied and local_name == "output_layer.weight":
        # The last stage's copy of the tied embedding.
        return "embedding.word_embeddings.weight"
    name = _shift(_LAYER, local_name, layer_offset)
    return _shift(_LOCAL_EXPERT, name, expert_offset)


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
    module: torch.nn.Module,
    seed: int,
    init_std: float,
    num_layers: int,
    tied: bool,
    gated: bool,
    layer_offset: int,
) -> None:
    """Redraw every randomly initialised parameter of this rank's module
    (a pipeline stage, or a virtual stage's chunk), whose first layer is
    global layer ``layer_offset``.

    Constant parameters (zero biases, unit norm weights) are already
    layout-invariant and are left as they are.
    """
    for local, param in module.named_parameters():
        flat = param.detach().view(-1)
        if flat.numel() == 0 or bool((flat == flat[0]).all()):
            continue
        tp_rank, tp_size, expert_offset = _split_of(param, local, module)
        name = global_name(local, layer_offset, tied, expert_offset)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        full = torch.empty(_full_shape(param, tp_size), dtype=torch.float32, device="cpu")
        full.normal_(0.0, _std(name, init_std, num_layers), generator=generator)
        if getattr(param, "tensor_model_parallel", False):
            is_gated_fc1 = gated and name.endswith("linear_fc1.weight")
            full = tp_slice(full, param.partition_dim, tp_rank, tp_size, is_gated_fc1)
        param.copy_(full.to(param.dtype))


def _split_of(param: torch.nn.Parameter, local_name: str, module: torch.nn.Module):
    """(tensor-parallel rank, size, first expert here) of a parameter: an
    expert's (marked allreduce=False by megatron-core) is split over the
    expert tensor-parallel group, and its experts over expert parallelism."""
    if getattr(param, "allreduce", True):
        return (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(),
            0,
        )
    if ".local_experts." not in local_name:
        raise ValueError(
            f"--layout-invariant-init knows experts as local_experts.K, not {local_name} "
            "(a grouped GEMM's): drop one of them"
        )
    experts = _experts_of(module, local_name)
    return (
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_world_size(),
        parallel_state.get_expert_model_parallel_rank() * experts.num_local_experts,
    )


def _experts_of(module: torch.nn.Module, local_name: str) -> torch.nn.Module:
    """The experts module (with num_local_experts) a parameter belongs to."""
    path = local_name.split(".local_experts.")[0]
    return module.get_submodule(path)
