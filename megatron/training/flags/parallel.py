"""Checks of the parallel layout: the world's split into tensor-,
pipeline- and context-parallel groups, the GPU each rank gets, and the
distributed optimizer's settings."""

import math
import os

from megatron.training import gpu_sharing
from megatron.training.config import Config
from megatron.training.flags import host
from megatron.training.flags.refusal import ConfigError, require


def check_gpus(config: Config) -> None:
    """A rank per GPU, or the sharing a test job asks for (gpu_sharing.py)."""
    if config.parallel.distributed_backend != "nccl":
        return
    try:
        mode = gpu_sharing.sharing_mode()
        gpu_sharing.memory_fraction()
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        gpu_sharing.device_index(local_ranks - 1, host.gpu_count(), mode)
        if mode == gpu_sharing.MULTI_RANK:
            import torch

            gpu_sharing.nccl_environment(mode, torch.cuda.nccl.version())
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check(config: Config) -> None:
    p, world = config.parallel, config.world_size
    tp, pp, cp = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
    )
    require(
        tp >= 1 and pp >= 1 and cp >= 1,
        "--tensor-model-parallel-size, --pipeline-model-parallel-size and "
        "--context-parallel-size must be at least 1",
    )
    cp_words = f" x context-parallel size {cp}" if cp > 1 else ""
    require(
        world % (tp * pp * cp) == 0,
        f"world size {world} is not divisible by tensor-parallel size {tp} x "
        f"pipeline-parallel size {pp}{cp_words} = {tp * pp * cp}: launch a multiple of "
        f"{tp * pp * cp} processes or change --tensor-model-parallel-size / "
        f"--pipeline-model-parallel-size" + (" / --context-parallel-size" if cp > 1 else ""),
    )
    _check_context_parallel(config)
    _check_optimizer_instances(config)
    require(
        not p.overlap_param_gather or p.use_distributed_optimizer,
        "--overlap-param-gather needs --use-distributed-optimizer",
    )
    require(
        not p.overlap_param_gather or p.overlap_grad_reduce,
        "--overlap-param-gather needs --overlap-grad-reduce",
    )
    _check_optimizer_step_overlap(config)
    require(p.distributed_timeout_minutes > 0, "--distributed-timeout-minutes must be > 0")


def _check_optimizer_step_overlap(config: Config) -> None:
    """Megatron-LM's rules for --overlap-param-gather-with-optimizer-step: the
    first chunk's all-gather is dispatched from the optimizer's step, which
    only the distributed optimizer's overlapped all-gather of interleaved
    chunks does, and its checkpoint is Megatron-LM's torch format."""
    p, flag = config.parallel, "--overlap-param-gather-with-optimizer-step"
    if not p.overlap_param_gather_with_optimizer_step:
        return
    require(p.use_distributed_optimizer, f"{flag} needs --use-distributed-optimizer")
    require(p.overlap_param_gather, f"{flag} needs --overlap-param-gather")
    require(
        config.virtual_pipeline_model_parallel_size is not None,
        f"{flag} needs the interleaved schedule: add --num-layers-per-virtual-pipeline-stage "
        "or --num-virtual-stages-per-pipeline-rank",
    )
    require(
        config.checkpoint.ckpt_format == "torch",
        f"{flag} saves and loads only --ckpt-format torch (Megatron-LM's distributed "
        f"checkpoint does not take it yet), not {config.checkpoint.ckpt_format}",
    )


def _check_optimizer_instances(config: Config) -> None:
    """megatron-core's rules for partial distributed optimizers: each instance
    shards over an equal part of the data-parallel (and expert data-parallel)
    ranks."""
    p = config.parallel
    copies = p.num_distributed_optimizer_instances
    if copies == 1:
        return
    require(copies > 1, f"--num-distributed-optimizer-instances {copies} must be >= 1")
    require(
        p.use_distributed_optimizer,
        f"--num-distributed-optimizer-instances {copies} copies the distributed optimizer: "
        "add --use-distributed-optimizer",
    )
    ranks = config.data_parallel_size * p.context_parallel_size
    require(
        ranks % copies == 0,
        f"--num-distributed-optimizer-instances {copies} does not divide the {ranks} "
        "data-parallel ranks (x context-parallel size): use a divisor of it",
    )


CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def _check_context_parallel(config: Config) -> None:
    """Megatron-LM's rules for context parallelism, and megatron-core's split
    of each sequence into 2 x CP chunks (a rank takes one from each end)."""
    p, m = config.parallel, config.model
    cp, kinds = p.context_parallel_size, p.cp_comm_type
    bad = [k for k in kinds if k not in CP_COMM_TYPES]
    require(not bad, f"--cp-comm-type {' '.join(bad)}: choose from {', '.join(CP_COMM_TYPES)}")
    require(
        len(kinds) in (1, m.num_layers),
        f"--cp-comm-type gives {len(kinds)} types: give one for all layers or one per layer "
        f"({m.num_layers})",
    )
    sizes = p.hierarchical_context_parallel_sizes
    require(
        sizes is None or math.prod(sizes) == cp,
        f"--hierarchical-context-parallel-sizes {sizes} multiply to {math.prod(sizes or [1])}, "
        f"not --context-parallel-size {cp}",
    )
    require(
        "a2a+p2p" not in kinds or sizes is not None,
        "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (as Megatron-LM)",
    )
    if cp == 1:
        return
    require(
        m.seq_length % (2 * cp) == 0,
        f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp}: "
        "each sequence is cut into that many equal chunks",
    )
