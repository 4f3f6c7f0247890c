"""Checks of the mixture of experts: the experts' split over the
expert-parallel ranks, the router, the token dispatcher and the kernels
each needs."""

import dataclasses
from typing import List

from megatron.training.config import Config, MoEConfig
from megatron.training.flags import host
from megatron.training.flags.refusal import flag_name, ignored_without, require


def check(config: Config) -> None:
    moe, p, m = config.moe, config.parallel, config.model
    if moe.num_experts is None:
        require(
            p.expert_model_parallel_size == 1,
            f"--expert-model-parallel-size {p.expert_model_parallel_size} splits experts, and "
            "there are none: add --num-experts N, or drop it (as Megatron-LM)",
        )
        ignored_without("--num-experts", False, [(f, True) for f in _moe_flags_given(config)])
        _check_expert_groups(config)  # megatron-core makes the expert groups all the same
        return
    ep, etp, tp, pp = (
        p.expert_model_parallel_size,
        p.expert_tensor_parallel_size,
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
    )
    require(moe.num_experts > 0, f"--num-experts {moe.num_experts} must be positive")
    require(
        ep >= 1 and moe.num_experts % ep == 0,
        f"--num-experts {moe.num_experts} is not divisible by --expert-model-parallel-size "
        f"{ep}: each expert-parallel rank holds the same number of experts",
    )
    require(
        1 <= moe.moe_router_topk <= moe.num_experts,
        f"--moe-router-topk {moe.moe_router_topk} must be between 1 and --num-experts "
        f"{moe.num_experts}",
    )
    _check_expert_groups(config)
    expert_dp = config.world_size // (etp * ep * pp)
    require(
        not p.use_tp_pp_dp_mapping or pp == 1 or expert_dp == config.data_parallel_size,
        f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {pp} needs the experts' "
        f"data-parallel size ({expert_dp}) to equal the model's ({config.data_parallel_size}) "
        "(megatron-core's rule for rank orders that do not end with the pipeline): drop "
        "--use-tp-pp-dp-mapping, or make --expert-model-parallel-size x "
        "--expert-tensor-parallel-size equal --tensor-model-parallel-size",
    )
    require(
        tp == 1 or p.sequence_parallel,
        "MoE layers with --tensor-model-parallel-size > 1 need --sequence-parallel "
        "(megatron-core's rule)",
    )
    require(
        m.disable_bias_linear or (etp == 1 and moe.moe_shared_expert_intermediate_size is None),
        "experts split by --expert-tensor-parallel-size > 1, and shared experts, have no "
        "biases in megatron-core: add --disable-bias-linear",
    )
    require(
        m.disable_bias_linear or ep > 1 or etp > 1 or host.uses_transformer_engine(config),
        "megatron-core's local expert layers with biases fail at expert-parallel and "
        "expert tensor-parallel size 1 (an in-place bias add on the output of an all-reduce "
        "it skips): add --disable-bias-linear, or set --expert-model-parallel-size > 1",
    )
    on_gpu = p.distributed_backend == "nccl"
    ignored_without(
        "--moe-token-dispatcher-type flex",
        moe.moe_token_dispatcher_type == "flex",
        [("--moe-flex-dispatcher-backend", moe.moe_flex_dispatcher_backend != "deepep")],
    )
    require(
        not moe.moe_enable_deepep or moe.moe_token_dispatcher_type == "flex",
        "--moe-enable-deepep goes with --moe-token-dispatcher-type flex (as Megatron-LM; it "
        "is deprecated: use --moe-flex-dispatcher-backend deepep)",
    )
    require(
        moe.moe_token_dispatcher_type != "flex" or (on_gpu and host.importable("deep_ep")),
        "--moe-token-dispatcher-type flex dispatches through DeepEP's or HybridEP's GPU "
        "kernels (the deep_ep package): use alltoall or allgather here",
    )
    require(
        not moe.moe_grouped_gemm
        or (on_gpu and (host.uses_transformer_engine(config) or host.importable("grouped_gemm"))),
        "--moe-grouped-gemm runs Transformer Engine's or the grouped_gemm package's GPU "
        "kernel: drop it here (each expert then runs its own GEMM)",
    )
    require(
        not moe.moe_pad_expert_input_to_capacity or moe.moe_expert_capacity_factor is not None,
        "--moe-pad-expert-input-to-capacity goes with --moe-expert-capacity-factor",
    )
    types, coeffs = moe.moe_router_load_balancing_type, moe.moe_aux_loss_coeff
    require(
        len(types if isinstance(types, list) else [types])
        == len(coeffs if isinstance(coeffs, list) else [coeffs])
        or not isinstance(types, list),
        "--moe-router-load-balancing-type and --moe-aux-loss-coeff need as many values as "
        "each other",
    )
    require(
        "sinkhorn" not in (types if isinstance(types, list) else [types])
        or not any(coeffs if isinstance(coeffs, list) else [coeffs]),
        "--moe-router-load-balancing-type sinkhorn balances without an auxiliary loss: "
        "drop --moe-aux-loss-coeff",
    )


def check_routing(config: Config) -> None:
    """--moe-layer-freq's pattern, and the routing flags that run Transformer
    Engine's kernels."""
    moe, layers = config.moe, config.model.num_layers
    if moe.num_experts is None:
        return  # check() said what has no effect
    ignored_without(
        "--moe-router-group-topk",
        moe.moe_router_group_topk is not None,
        [("--moe-router-num-groups", moe.moe_router_num_groups is not None)],
    )
    rate = MoEConfig.__dataclass_fields__["moe_router_bias_update_rate"].default
    ignored_without(
        "--moe-router-enable-expert-bias",
        moe.moe_router_enable_expert_bias,
        [("--moe-router-bias-update-rate", moe.moe_router_bias_update_rate != rate)],
    )
    freq = moe.moe_layer_freq
    require(
        not isinstance(freq, list) or len(freq) == layers,
        f"--moe-layer-freq gives {len(freq) if isinstance(freq, list) else 0} layers and "
        f"--num-layers is {layers}: give one 0 or 1 per layer",
    )
    require(
        isinstance(freq, list) or 1 <= freq <= layers,
        f"--moe-layer-freq {freq} must be between 1 and --num-layers {layers}",
    )
    on_gpu = config.parallel.distributed_backend == "nccl"
    for flag, given in (
        ("--moe-permute-fusion", moe.moe_permute_fusion),
        ("--moe-router-fusion", moe.moe_router_fusion),
    ):
        require(
            not given or (on_gpu and host.uses_transformer_engine(config)),
            f"{flag} runs Transformer Engine's fused kernel on a GPU: drop it here (the "
            "unfused code computes the same)",
        )


def _moe_flags_given(config: Config) -> List[str]:
    """The MoE flags set away from their defaults (--num-experts aside)."""
    given = [
        flag_name(f)
        for f in dataclasses.fields(MoEConfig)
        if f.name != "num_experts" and getattr(config.moe, f.name) != f.default
    ]
    p = config.parallel
    if p.expert_model_parallel_size != 1:
        given.append("--expert-model-parallel-size")
    if p.expert_tensor_parallel_size != p.tensor_model_parallel_size:
        given.append("--expert-tensor-parallel-size")
    return given


def _check_expert_groups(config: Config) -> None:
    p = config.parallel
    etp, ep, pp = (
        p.expert_tensor_parallel_size,
        p.expert_model_parallel_size,
        p.pipeline_model_parallel_size,
    )
    require(
        etp >= 1 and config.world_size % (etp * ep * pp) == 0,
        f"world size {config.world_size} is not divisible by expert tensor-parallel size "
        f"{etp} x expert-parallel size {ep} x pipeline-parallel size {pp}: change "
        "--expert-model-parallel-size or --expert-tensor-parallel-size",
    )
