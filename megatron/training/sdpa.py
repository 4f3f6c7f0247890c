"""torch's ``scaled_dot_product_attention`` behind megatron-core's core-attention interface.

It is the module that ``--attention-backend`` puts in the layer spec's
``core_attention`` slot where Transformer Engine is absent
(megatron/training/attention.py says when, and why).
"""

import contextlib
import dataclasses
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

# --attention-backend -> the SDPA kernels it allows (None: torch chooses).
SDPA_KERNELS = {
    "auto": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "fused": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
    "unfused": [SDPBackend.MATH],
}


class TorchSdpaAttention(MegatronModule):
    """megatron-core's core-attention interface on torch's SDPA: queries
    [sq, b, heads, dim], keys and values [sk, b, groups, dim] in, context
    [sq, b, heads * value dim] out, for this tensor-parallel rank's heads."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
    ):
        # k_channels and v_channels: multi-latent attention's head dimensions
        # (its values' differ from its queries' and keys'), which SDPA reads
        # from the tensors; only the default scale needs the first.
        super().__init__(config=config)
        unsupported = _unsupported(config)
        if unsupported:
            raise ValueError(f"torch SDPA core attention: {unsupported} is not supported")
        self.attn_mask_type = attn_mask_type
        tp = pg_collection.tp.size() if pg_collection is not None else _tp_size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.scale = softmax_scale or 1.0 / math.sqrt(k_channels or config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.kernels = SDPA_KERNELS[config.attention_backend.name]
        self.cp_group = None
        if config.context_parallel_size > 1:
            self.cp_group = pg_collection.cp if pg_collection is not None else _cp_group()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("torch SDPA core attention takes no packed sequences or bias")
        seq, batch = query.shape[0], query.shape[1]
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        if self.cp_group is not None:
            key, value = (whole_sequence(t, self.cp_group) for t in (key, value))
            if attention_mask is None and causal:
                attention_mask = later_keys(self.cp_group, seq, query.device)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        gqa = self.heads != self.groups
        if gqa and self.kernels == SDPA_KERNELS["fused"]:
            # The memory-efficient kernel takes no grouped keys: expand them.
            k, v = (t.repeat_interleave(self.heads // self.groups, dim=1) for t in (k, v))
            gqa = False
        dropout = self.dropout if self.training else 0.0
        with self._kernels(), self._dropout_stream(dropout):
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                # megatron's mask marks what is hidden, SDPA's what is seen.
                attn_mask=None if attention_mask is None else ~attention_mask,
                dropout_p=dropout,
                is_causal=causal and attention_mask is None,
                scale=self.scale,
                enable_gqa=gqa,
            )
        return context.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _kernels(self):
        return contextlib.nullcontext() if self.kernels is None else sdpa_kernel(self.kernels)

    def _dropout_stream(self, dropout: float):
        """As megatron-core's attention: dropout masks from the model-parallel
        RNG stream (each tensor-parallel rank its own heads' masks), except
        under sequence parallelism."""
        if dropout == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        return {}  # no parameters


# ----- context parallelism -----
# megatron-core cuts each sequence into 2 x CP chunks and gives context-parallel
# rank r chunks r and 2CP-1-r (get_batch_on_this_cp_rank: every rank then
# has as much causal work). A rank's queries attend to the whole sequence's
# keys and values, gathered from the group and put back in sequence order
# (the gather's backward sums each rank's gradients into the owner's). This
# is Transformer Engine's "allgather" communication, in its simplest form.
def whole_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """[s/CP, b, ...] on each rank -> [s, b, ...] in sequence order."""
    size = group.size()
    gathered = tensor_parallel.gather_from_sequence_parallel_region(local, True, group)
    chunks = gathered.chunk(2 * size)  # rank r's two chunks at 2r and 2r+1
    order = [2 * r for r in range(size)] + [2 * r + 1 for r in reversed(range(size))]
    return torch.cat([chunks[i] for i in order])


def chunk_positions(rank: int, size: int, local_length: int) -> torch.Tensor:
    """The sequence positions of a context-parallel rank's tokens."""
    half = local_length // 2
    first, second = rank * half, (2 * size - 1 - rank) * half
    return torch.cat([torch.arange(first, first + half), torch.arange(second, second + half)])


def later_keys(group, local_length: int, device) -> torch.Tensor:
    """The causal mask of this rank's queries over the whole sequence's keys,
    in megatron's sense (True: hidden), [1, 1, s/CP, s]."""
    size = group.size()
    queries = chunk_positions(group.rank(), size, local_length).to(device)
    keys = torch.arange(local_length * size, device=device)
    return (keys[None, :] > queries[:, None])[None, None]


def _cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def _unsupported(config) -> Optional[str]:
    if getattr(config, "window_size", None) is not None:
        return "sliding-window attention"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        return f"softmax type {config.softmax_type}"
    return None


def _tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def with_core_attention(spec, module: type):
    """A copy of a GPT layer spec, or of a decoder block's submodules (an MoE
    model's, as megatron-core's block spec builder returns them), whose
    self-attention computes its core attention with ``module``."""
    layers: Optional[List] = getattr(spec, "layer_specs", None)
    if layers is not None:
        return dataclasses.replace(
            spec, layer_specs=[with_core_attention(s, module) for s in layers]
        )
    attention = spec.submodules.self_attention
    swapped = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(attention.submodules, core_attention=module),
    )
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=swapped)
    )
