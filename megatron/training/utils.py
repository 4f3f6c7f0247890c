"""Megatron-LM's batch helpers for scripts written against its training API (megatron_lm.py).

The same names, arguments and results, for what this build trains (no
packed sequences or multi-token prediction).
"""

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: F401 - Megatron-LM's too

from megatron.training.global_vars import get_args
from megatron.training.megatron_lm import print_rank_0  # noqa: F401 - Megatron-LM's home too


def is_first_or_last_pipeline_stage(vp_stage: Optional[int] = None) -> bool:
    """Whether this rank's model chunk (``vp_stage`` with virtual stages)
    reads data: the first stage embeds tokens, the last computes the loss."""
    whole = parallel_state.get_virtual_pipeline_model_parallel_world_size() is None
    return parallel_state.is_pipeline_first_stage(
        ignore_virtual=whole, vp_stage=vp_stage
    ) or parallel_state.is_pipeline_last_stage(ignore_virtual=whole, vp_stage=vp_stage)


def get_blend_and_blend_per_split(args):
    """(blend, blend_per_split) from ``--data-path`` (prefixes, or weights and
    prefixes); per-split paths are not flags here, so the second is None."""
    from megatron.training.data import blend

    return blend(args.data_path), None


# What each stage needs of a batch (Megatron-LM's): the first stage embeds
# tokens, the last computes the loss.
EVERYTHING = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
FIRST_STAGE = ("tokens", "attention_mask", "position_ids")
LAST_STAGE = ("labels", "loss_mask", "attention_mask")
DTYPES = {"tokens": torch.int64, "labels": torch.int64, "position_ids": torch.int64}
DTYPES.update(loss_mask=torch.float32, attention_mask=torch.bool)


def get_batch_on_this_tp_rank(data_iterator, mtp_on_this_rank: bool = False) -> dict:
    """The next microbatch on every rank of this tensor-parallel group: its
    first rank reads it and broadcasts what the stage needs to the others
    (whose iterator may be None: Megatron-LM's datasets provider builds data
    on the first only). Keys as Megatron-LM's, the packed-sequence ones None."""
    if mtp_on_this_rank:
        raise ValueError("get_batch_on_this_tp_rank: multi-token prediction is not built here")
    args = get_args()
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        needed = EVERYTHING
    elif parallel_state.is_pipeline_first_stage():
        needed = FIRST_STAGE
    elif parallel_state.is_pipeline_last_stage():
        needed = LAST_STAGE
    else:
        needed = ()
    device = torch.cuda.current_device()
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        batch = {k: data[k].cuda(non_blocking=True) if k in data else None for k in EVERYTHING}
    else:  # what its stage needs arrives; the rest is None (as Megatron-LM's)
        batch = {k: _empty(k, args, device) if k in needed else None for k in EVERYTHING}
    for key in needed:
        if batch[key] is not None:
            torch.distributed.broadcast(
                batch[key],
                parallel_state.get_tensor_model_parallel_src_rank(),
                group=parallel_state.get_tensor_model_parallel_group(),
            )
    return dict(batch, cu_seqlens=None, cu_seqlens_padded=None, max_seqlen=None, local_cp_size=None)


def _empty(key: str, args, device) -> Optional[torch.Tensor]:
    """The buffer a microbatch's ``key`` arrives in on a rank that does not
    read data (None: an attention mask the data loader does not make)."""
    if key == "attention_mask":
        if not args.create_attention_mask_in_dataloader:
            return None
        shape = (args.micro_batch_size, 1, args.seq_length, args.seq_length)
    else:
        shape = (args.micro_batch_size, args.seq_length)
    return torch.empty(shape, dtype=DTYPES[key], device=device)
