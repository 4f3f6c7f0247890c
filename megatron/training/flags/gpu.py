"""Checks of the GPU-only features (the gpu section), refused by name off a GPU.

They are Transformer Engine's communication overlap, delayed weight
gradients, activation offloading and CUDA graphs."""

import dataclasses
import os
from typing import List

from megatron.training.config import Config, GpuConfig
from megatron.training.flags import host
from megatron.training.flags.refusal import flag_name, ignored_without, require


def gpu_features_given(config: Config) -> List[str]:
    """The GPU-only features of the gpu section that a run asks for, by flag."""
    g = config.gpu
    given = [
        ("--tp-comm-overlap", g.tp_comm_overlap),
        ("--overlap-moe-expert-parallel-comm", g.overlap_moe_expert_parallel_comm),
        ("--delay-wgrad-compute", g.delay_wgrad_compute),
        ("--fine-grained-activation-offloading", g.fine_grained_activation_offloading),
        (
            "--external-cuda-graph"
            if g.external_cuda_graph
            else "--cuda-graph-impl " + g.cuda_graph_impl,
            g.cuda_graph_impl != "none",
        ),
        ("--te-rng-tracker", g.te_rng_tracker and g.cuda_graph_impl == "none"),
    ]
    return [flag for flag, on in given if on]


def check(config: Config) -> None:
    """Megatron-LM's rules for the gpu section, and where each runs: on a GPU
    with Transformer Engine (megatron-core checks the rest of each when it
    builds its configuration, megatron_core.check)."""
    g = config.gpu
    on_gpu = config.parallel.distributed_backend == "nccl"
    given = gpu_features_given(config)
    require(
        not given or on_gpu,
        f"{', '.join(given)}: GPU only (CUDA streams and kernels): drop it here",
    )
    # All but the MoE overlap's schedule are Transformer Engine's.
    with_te = [flag for flag in given if flag != "--overlap-moe-expert-parallel-comm"]
    require(
        not with_te or host.uses_transformer_engine(config),
        f"{', '.join(with_te)}: needs Transformer Engine (--transformer-impl "
        "transformer_engine, its package installed): drop it here",
    )
    _check_tp_comm_overlap(config)
    for flag, alone in (
        ("--delay-wgrad-compute", g.delay_wgrad_compute),
        ("--ep-overlap-early-attn-memory-release", g.ep_overlap_early_attn_memory_release),
    ):  # megatron-core refuses either alone
        require(
            not alone or g.overlap_moe_expert_parallel_comm,
            f"{flag} goes with --overlap-moe-expert-parallel-comm",
        )
    _check_delayed_wgrad(config)
    _check_activation_offloading(config)
    _check_cuda_graphs(config)


def _check_tp_comm_overlap(config: Config) -> None:
    g = config.gpu
    defaults = GpuConfig()
    ignored_without(
        "--tp-comm-overlap",
        g.tp_comm_overlap,
        [("--tp-comm-overlap-cfg", g.tp_comm_overlap_cfg is not None)]
        + [
            (flag_name(f), getattr(g, f.name) != getattr(defaults, f.name))
            for f in dataclasses.fields(GpuConfig)
            if f.name.startswith("tp_comm_") and f.name != "tp_comm_overlap_cfg"
        ],
    )
    if not g.tp_comm_overlap:
        return
    require(
        config.parallel.sequence_parallel,
        "--tp-comm-overlap overlaps sequence-parallel communication: add --sequence-parallel",
    )
    cfg = g.tp_comm_overlap_cfg
    require(
        cfg is None or os.path.isfile(cfg),
        f"--tp-comm-overlap-cfg {cfg}: no such file",
    )


def _check_delayed_wgrad(config: Config) -> None:
    """Megatron-LM's Transformer Engine versions for --delay-wgrad-compute."""
    version = host.package_version("transformer_engine")
    if not config.gpu.delay_wgrad_compute or version is None:
        return
    require(
        not config.parallel.overlap_grad_reduce or version >= (2, 8),
        "--delay-wgrad-compute with --overlap-grad-reduce needs Transformer Engine 2.8 or later",
    )
    require(
        config.training.gradient_accumulation_fusion or version >= (2, 7),
        "--delay-wgrad-compute with --no-gradient-accumulation-fusion needs Transformer "
        "Engine 2.7 or later",
    )


def _check_activation_offloading(config: Config) -> None:
    g = config.gpu
    ignored_without(
        "--fine-grained-activation-offloading",
        g.fine_grained_activation_offloading,
        [
            ("--offload-modules", bool(g.offload_modules)),
            (
                "--min-offloaded-tensor-size",
                g.min_offloaded_tensor_size != GpuConfig().min_offloaded_tensor_size,
            ),
        ],
    )
    if not g.fine_grained_activation_offloading:
        return
    require(
        bool(g.offload_modules),
        "--fine-grained-activation-offloading needs --offload-modules (what to offload)",
    )
    require(
        host.importable("cuda") and host.importable("pynvml"),
        "--fine-grained-activation-offloading pins each rank to its GPU's CPUs, as "
        "Megatron-LM, with the cuda-python and nvidia-ml-py packages: install them",
    )
    version = host.package_version("transformer_engine")
    require(
        version is None or version < (2, 10) or os.environ.get("NVTE_CPU_OFFLOAD_V1") == "1",
        "--fine-grained-activation-offloading with Transformer Engine 2.10 or later needs "
        "NVTE_CPU_OFFLOAD_V1=1 in the environment (else it offloads the weights too)",
    )


# --cuda-graph-scope's values (megatron-core's CudaGraphScope names, less
# full_iteration: the scope of megatron-core's own graphs, not here).
CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full")


def _check_cuda_graphs(config: Config) -> None:
    g = config.gpu
    require(
        g.cuda_graph_impl != "local",
        "--cuda-graph-impl local (megatron-core's own graphs) is not here: use transformer_engine",
    )
    bad = [scope for scope in g.cuda_graph_scope if scope not in CUDA_GRAPH_SCOPES]
    require(
        not bad,
        f"--cuda-graph-scope {' '.join(bad)}: not a scope of Transformer Engine's graphs "
        f"(choose from {', '.join(CUDA_GRAPH_SCOPES[:-1])})",
    )
    ignored_without(
        "--cuda-graph-impl",
        g.cuda_graph_impl != "none",
        [
            ("--cuda-graph-scope", g.cuda_graph_scope != []),
            (
                "--cuda-graph-warmup-steps",
                g.cuda_graph_warmup_steps != GpuConfig().cuda_graph_warmup_steps,
            ),
        ],
    )
    if g.cuda_graph_impl == "none":
        return
    require(g.cuda_graph_warmup_steps >= 0, "--cuda-graph-warmup-steps must be >= 0")
    require(
        "expandable_segments:True" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        or os.environ.get("NCCL_GRAPH_REGISTER") == "0",
        "CUDA graphs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True need "
        "NCCL_GRAPH_REGISTER=0 in the environment (an illegal memory access otherwise)",
    )
