"""Which core attention a run gets: Transformer Engine's, megatron-core's,
or torch's ``scaled_dot_product_attention`` (SDPA, megatron/training/sdpa.py).
Pure: parsing imports it before megatron-core.

megatron-core's own core attention (``DotProductAttention``, the local
layer spec's) materialises the [batch, heads, s, s] score matrix and runs
scaling, masking, softmax and dropout as separate kernels. On a GPU without
Transformer Engine that is the attention a run got: a 1.3B GPT reached a
fifth of an H200's bf16 peak with it. torch ships fused attention kernels
(flash, memory-efficient, cuDNN) behind one function, so sdpa.py puts
that function in the layer spec's ``core_attention`` slot: the same inputs
and output as megatron-core's, dropout drawn from the same model-parallel
RNG stream, and no package beyond torch. We write this small adapter
because no library offers one: megatron-core's only SDPA path is NVIDIA
Kitchen's (``use_kitchen_attention``), a package that is not public.

Which core attention a run gets (``core_attention_kind``), by
``--attention-backend``, Megatron-LM's flag:

=========  ======================  =====================================
backend    with Transformer Engine  without it
=========  ======================  =====================================
auto       TE's (it picks)          SDPA, torch picks the kernel, on a
                                    GPU; megatron-core's on a CPU
flash      TE's flash               SDPA's flash kernel
fused      TE's fused (cuDNN)       SDPA's memory-efficient or cuDNN
                                    kernel (GPU only)
unfused    TE's unfused             SDPA's math kernel (torch's unfused)
local      refused                  megatron-core's ``DotProductAttention``
=========  ======================  =====================================

On a CPU ``auto`` keeps megatron-core's attention, which the CPU test
suite's references and Megatron-LM checkpoint tests were made with, unless
the run needs what megatron-core's attention lacks and SDPA here has
(``local_attention_lacks``): context parallelism (--context-parallel-size >
1: each rank's queries attend to keys and values gathered from the
context-parallel group), or multi-latent attention's heads (values of
another head dimension than queries and keys).
"""

from typing import Optional

TE, LOCAL, SDPA = "transformer_engine", "local", "sdpa"


def attention_masked_by(config) -> Optional[str]:
    """The flag that gives this run's core attention a mask, if any: the data
    loader's masks, or context parallelism's (queries against the keys of
    the whole sequence)."""
    if config.data.reset_attention_mask and config.data.create_attention_mask_in_dataloader:
        return "--reset-attention-mask"
    if config.parallel.context_parallel_size > 1:
        return "--context-parallel-size > 1"
    return None


def local_attention_lacks(config) -> Optional[str]:
    """What this run needs that megatron-core's own core attention lacks
    (None: nothing)."""
    if config.parallel.context_parallel_size > 1:
        return "context parallelism"
    if config.model.multi_latent_attention:
        return "multi-latent attention's head dimensions"
    return None


def core_attention_kind(
    backend: str, uses_te: bool, on_cpu: bool, local_lacks: Optional[str] = None
) -> str:
    """Whose core attention a run gets: Transformer Engine's, megatron-core's
    (local) or torch's SDPA (the table in this module's docstring). Where
    megatron-core's attention lacks what the run needs (``local_lacks``),
    ``auto`` on a CPU is SDPA."""
    if uses_te:
        return TE
    if backend == "local" or (backend == "auto" and on_cpu and local_lacks is None):
        return LOCAL
    return SDPA


def attention_problem(
    backend: str,
    uses_te: bool,
    on_cpu: bool,
    dropout: float,
    masked_by: Optional[str] = None,
    local_lacks: Optional[str] = None,
) -> Optional[str]:
    """Why this backend cannot run here (a message naming what to change),
    or None. ``masked_by``: the flag that gives the attention a mask;
    ``local_lacks``: what megatron-core's attention lacks that the run
    needs. Checked when the flags are parsed."""
    if uses_te and backend == "local":
        return (
            "--attention-backend local is megatron-core's own attention, which goes with "
            "its local layers: add --transformer-impl local, or choose auto, flash, fused "
            "or unfused (Transformer Engine's)"
        )
    kind = core_attention_kind(backend, uses_te, on_cpu, local_lacks)
    if kind == LOCAL and local_lacks is not None:
        return (
            f"--attention-backend local (megatron-core's own attention) has no {local_lacks}: "
            "use auto or unfused (torch's SDPA), or Transformer Engine's layers"
        )
    if kind != SDPA:
        return None
    if backend == "flash" and masked_by is not None:
        return (
            "--attention-backend flash is torch's flash kernel without Transformer Engine, "
            f"which takes no attention mask: with {masked_by} use auto or unfused"
        )
    if not on_cpu:
        return None
    if backend == "fused":
        return (
            "--attention-backend fused is torch's memory-efficient or cuDNN attention "
            "without Transformer Engine, which needs a GPU: use unfused, flash or local here"
        )
    if backend == "flash" and dropout > 0:
        return (
            f"--attention-backend flash on a CPU is torch's CPU flash kernel, which has no "
            f"dropout: add --attention-dropout 0 (now {dropout}), or use unfused"
        )
    return None
