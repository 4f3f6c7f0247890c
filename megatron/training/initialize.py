"""Start the distributed runtime: device, process groups, parallel state, seeds."""

import datetime
import logging
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.config import set_experimental_flag
from megatron.core.rerun_state_machine import (
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    destroy_rerun_state_machine,
    initialize_rerun_state_machine,
)

from megatron.training import cpu_compat, gpu_sharing, optimizer_layout
from megatron.training.config import Config


@dataclass
class Runtime:
    """Where this process stands in the job, fixed once groups exist."""

    rank: int
    world_size: int
    local_rank: int
    on_cpu: bool
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1


def setup_device(config: Config) -> bool:
    """Pick the device before anything touches CUDA, and set the process's
    switches (every process runs this: a trainer, a spare). Returns True on
    CPU."""
    on_cpu = config.parallel.cpu or not torch.cuda.is_available()
    cpu_compat.define_missing_te_names()
    optimizer_layout.patch_reshardable_load()
    optimizer_layout.patch_reshardable_save()
    if config.training.deterministic_mode:  # as Megatron-LM
        torch.use_deterministic_algorithms(True)
    if config.training.enable_experimental:
        set_experimental_flag(True)
    if on_cpu:
        cpu_compat.enable(force=True)
    else:
        if config.training.deterministic_mode:
            # cuBLAS is deterministic only with a fixed workspace, read when
            # its first handle is made (torch refuses the GEMMs otherwise).
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # One GPU per rank, unless a test job shares GPUs (gpu_sharing.py).
        gpu_sharing.apply(int(os.environ.get("LOCAL_RANK", "0")))
    return on_cpu


def init_process_groups(config: Config) -> None:
    """Default group from torchrun's environment, then megatron's groups."""
    p = config.parallel
    timeout = datetime.timedelta(minutes=p.distributed_timeout_minutes)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=p.distributed_backend,
            timeout=timeout,
            world_size=config.world_size,
            rank=int(os.environ.get("RANK", "0")),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        hierarchical_context_parallel_sizes=p.hierarchical_context_parallel_sizes,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        distributed_timeout_minutes=int(max(1, p.distributed_timeout_minutes)),
        order="tp-cp-ep-pp-dp" if p.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        # Our checkpoints and mirrors never gather through gloo twins of the
        # data-parallel groups; not creating them halves group setup.
        create_gloo_process_groups=False,
    )


def rerun_mode(config: Config) -> str:
    """--rerun-mode, Megatron-LM's default validate_results when not given."""
    return config.training.rerun_mode or "validate_results"


def start_validation(config: Config) -> None:
    """megatron-core's rerun state machine, through which its DDP and the
    loss function validate results (--check-for-nan-in-loss-and-grad,
    --check-for-spiky-loss), in --rerun-mode's mode, as Megatron-LM sets it
    up: a rerun restores the model-parallel RNG tracker's streams too. Made
    again for a rebuilt trainer."""
    t = config.training

    def save_streams():
        return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def restore_streams(saved):
        if saved["rng_tracker_states"]:
            tensor_parallel.get_cuda_rng_tracker().set_states(saved["rng_tracker_states"])

    destroy_rerun_state_machine()
    initialize_rerun_state_machine(
        state_save_func=save_streams,
        state_restore_func=restore_streams,
        mode=RerunMode(rerun_mode(config)),
        error_injector=RerunErrorInjector(
            error_injection_rate=t.error_injection_rate,
            error_injection_type=RerunDiagnostic(t.error_injection_type),
        ),
        result_rejected_tracker_filename=t.result_rejected_tracker_filename,
    )


def set_seeds(seed: int) -> None:
    """Megatron's seeding: pipeline stages differ, DP peers agree, and the
    model-parallel RNG tracker gives TP ranks their dropout streams."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def logging_level(config: Config):
    """As Megatron-LM: --logging-level, else MEGATRON_LOGGING_LEVEL, else
    None (Python's root logger keeps its level)."""
    given = config.logging.logging_level
    if given is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        given = int(os.environ["MEGATRON_LOGGING_LEVEL"])  # arguments.py checked it
    return given


def set_logging_level(config: Config) -> None:
    """The root logger's level, which megatron-core's module loggers follow.
    The training log (our rank loggers and lines) keeps its own, as
    Megatron-LM's printed log does."""
    level = logging_level(config)
    if level is not None:
        logging.getLogger().setLevel(level)


def initialize(config: Config) -> Runtime:
    """Everything between a validated config and building the model."""
    set_logging_level(config)
    on_cpu = setup_device(config)
    init_process_groups(config)
    start_validation(config)
    set_seeds(config.training.seed)
    return Runtime(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        on_cpu=on_cpu,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
    )
