"""Start the distributed runtime: device, process groups, parallel state, seeds."""

import datetime
import logging
import os
import random
from dataclasses import dataclass
from typing import Optional

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
from megatron.training.config import Config, GpuConfig


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


# Whether this process runs on the CPU, once setup_device has set it up.
_on_cpu: Optional[bool] = None


def setup_device(config: Config) -> bool:
    """Pick the device before anything touches CUDA, and set the process's
    switches: once per process (a deadpool rank does it before its first
    group or its warm-up, and each trainer it builds later, through
    initialize, finds it done). Returns True on CPU."""
    global _on_cpu
    if _on_cpu is None:
        _on_cpu = set_device_switches(config)
    return _on_cpu


def set_device_switches(config: Config) -> bool:
    """Every process's switches (a trainer's, a spare's); True on CPU."""
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


def set_seeds(seed: int, gpu: GpuConfig) -> None:
    """Megatron's seeding: pipeline stages differ, DP peers agree, and the
    model-parallel RNG tracker gives TP ranks their dropout streams
    (Transformer Engine's tracker with --te-rng-tracker, one that CUDA graphs
    can capture with them)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    seed_model_parallel_streams(seed, gpu)


def seed_model_parallel_streams(seed: int, gpu: GpuConfig) -> None:
    """megatron-core's tracker and the device's default stream from ``seed``
    (Transformer Engine's tracker with --te-rng-tracker, streams CUDA graphs
    can capture with them): at start, and for each microbatch under
    --deadpool-sample-rng."""
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed,
        te_rng_tracker=gpu.te_rng_tracker,
        use_cudagraphable_rng=gpu.cuda_graph_impl != "none",
    )


def init_tp_communicators(config: Config) -> None:
    """--tp-comm-overlap: Transformer Engine's userbuffers for one
    microbatch's sequence-parallel activations, set up as Megatron-LM sets
    them up (its YAML settings per GEMM from --tp-comm-overlap-cfg)."""
    import yaml
    from transformer_engine.pytorch import module as te_module

    g, m, p, t = config.gpu, config.model, config.parallel, config.training
    settings = {}
    if g.tp_comm_overlap_cfg is not None:
        with open(g.tp_comm_overlap_cfg) as f:
            settings = yaml.safe_load(f) or {}
    rows = config.batch.micro_batch_size * m.seq_length // p.context_parallel_size
    common = dict(
        shape=[rows, m.hidden_size],
        tp_size=p.tensor_model_parallel_size,
        ub_cfgs=settings,
        bootstrap_backend=g.tp_comm_bootstrap_backend,
    )
    modes = getattr(te_module.base, "UserBufferQuantizationMode", None)
    if modes is None:  # Transformer Engine before 2.7
        te_module.base.initialize_ub(use_fp8=t.fp8 is not None, **common)
        return
    quantization = [modes.FP8 if t.fp8 else modes.NONE]
    if (
        t.fp8
        and t.first_last_layers_bf16
        and (t.num_layers_at_start_in_bf16 > 0 or t.num_layers_at_end_in_bf16 > 0)
    ):
        quantization.append(modes.NONE)  # the bf16 layers' buffers
    te_module.base.initialize_ub(quantization_modes=quantization, **common)


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
    if config.gpu.fine_grained_activation_offloading:
        from megatron.core.pipeline_parallel.utils import set_ideal_affinity_for_current_gpu

        set_ideal_affinity_for_current_gpu()  # as Megatron-LM: host copies near the GPU
    if config.gpu.cuda_graph_impl == "transformer_engine":
        # As Megatron-LM: graphs are captured off the default stream.
        torch.cuda.set_stream(torch.cuda.Stream())
    init_process_groups(config)
    if config.gpu.tp_comm_overlap:
        init_tp_communicators(config)
    start_validation(config)
    set_seeds(config.training.seed, config.gpu)
    return Runtime(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        on_cpu=on_cpu,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
    )
