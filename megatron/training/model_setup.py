"""Model, DDP wrapper, distributed optimizer and LR scheduler from a Config."""

import importlib.util
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.activations import squared_relu
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import MLATransformerConfig, TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron.training import attention, layout_invariant_init
from megatron.training.config import Config
from megatron.training.schedule import schedule_in_samples


def params_dtype(config: Config) -> torch.dtype:
    t = config.training
    return torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32


def use_transformer_engine(config: Config, on_cpu: bool) -> bool:
    """TE's layers when asked, or by default when importable on a GPU."""
    impl = config.model.transformer_impl
    if impl == "auto":
        return not on_cpu and importlib.util.find_spec("transformer_engine") is not None
    return impl == "transformer_engine"


def with_run_attention(spec, config: Config, on_cpu: bool):
    """The layer (or block) spec with the core attention this run gets
    (megatron/training/attention.py): torch's SDPA in place of megatron-core's
    where Transformer Engine is absent and --attention-backend asks for it."""
    kind = attention.core_attention_kind(
        config.model.attention_backend,
        use_transformer_engine(config, on_cpu),
        on_cpu,
        attention.local_attention_lacks(config),
    )
    if kind != attention.SDPA:
        return spec
    from megatron.training.sdpa import TorchSdpaAttention, with_core_attention

    return with_core_attention(spec, TorchSdpaAttention)


def transformer_config(config: Config, on_cpu: bool) -> TransformerConfig:
    """megatron-core's TransformerConfig for this run's shape and layout
    (its MLATransformerConfig with --multi-latent-attention)."""
    m, p, t = config.model, config.parallel, config.training
    fused = not on_cpu  # fused kernels need CUDA (and often apex)
    config_class = MLATransformerConfig if m.multi_latent_attention else TransformerConfig
    return config_class(
        **moe_settings(config),
        **latent_attention_settings(config),
        **fusion_settings(config, on_cpu),
        **gpu_settings(config),
        num_layers=m.num_layers,
        mtp_num_layers=m.mtp_num_layers,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.kv_channels,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        layernorm_epsilon=m.norm_epsilon,
        normalization=m.normalization,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p,
        gated_linear_unit=m.swiglu,
        activation_func=activation(config),
        add_bias_linear=not m.disable_bias_linear,
        add_qkv_bias=m.add_qkv_bias or not m.disable_bias_linear,  # as Megatron-LM
        qk_layernorm=m.qk_layernorm,
        test_mode=m.test_mode,
        rotary_interleaved=m.rotary_interleaved,
        attention_softmax_in_fp32=m.attention_softmax_in_fp32,
        apply_query_key_layer_scaling=m.apply_query_key_layer_scaling,
        deterministic_mode=t.deterministic_mode,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        cp_comm_type=p.cp_comm_type[0] if len(p.cp_comm_type) == 1 else p.cp_comm_type,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_layout=p.pipeline_model_parallel_layout,
        num_layers_in_first_pipeline_stage=p.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=p.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split,
        microbatch_group_size_per_vp_stage=p.microbatch_group_size_per_vp_stage,
        overlap_p2p_comm=p.overlap_p2p_comm,
        overlap_p2p_comm_warmup_flush=p.overlap_p2p_comm_warmup_flush,
        batch_p2p_comm=not p.overlap_p2p_comm,  # as Megatron-LM
        sequence_parallel=p.sequence_parallel,
        params_dtype=params_dtype(config),
        pipeline_dtype=params_dtype(config),
        bf16=t.bf16,
        fp16=t.fp16,
        bias_dropout_fusion=fused,
        masked_softmax_fusion=fused and m.masked_softmax_fusion and softmax_kernel_built(),
        attention_backend=AttnBackend[m.attention_backend],
        persist_layer_norm=fused and not m.no_persist_layer_norm and layer_norm_can_persist(config),
        calculate_per_token_loss=t.calculate_per_token_loss,
        defer_embedding_wgrad_compute=t.defer_embedding_wgrad_compute,
        wgrad_deferral_limit=t.wgrad_deferral_limit,
        **recompute_settings(config),
        cross_entropy_loss_fusion=m.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=m.cross_entropy_fusion_impl,
        # FP8 (Transformer Engine on a GPU only: arguments.py refuses it elsewhere)
        fp8=t.fp8,
        fp8_recipe=t.fp8_recipe,
        fp8_amax_history_len=t.fp8_amax_history_len,
        fp8_amax_compute_algo=t.fp8_amax_compute_algo,
        fp8_param=t.fp8_param_gather,
        first_last_layers_bf16=t.first_last_layers_bf16,
        num_layers_at_start_in_bf16=t.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=t.num_layers_at_end_in_bf16,
    )


def gpu_settings(config: Config) -> dict:
    """megatron-core's fields for the GPU-only features (arguments.py refuses
    them elsewhere): Transformer Engine's tensor-parallel overlap, the MoE
    communication overlap, activation offloading and CUDA graphs."""
    g = config.gpu
    return dict(
        tp_comm_overlap=g.tp_comm_overlap,
        tp_comm_overlap_ag=g.tp_comm_overlap_ag,
        tp_comm_overlap_rs=g.tp_comm_overlap_rs,
        tp_comm_overlap_rs_dgrad=g.tp_comm_overlap_rs_dgrad,
        tp_comm_bulk_dgrad=g.tp_comm_bulk_dgrad,
        tp_comm_bulk_wgrad=g.tp_comm_bulk_wgrad,
        tp_comm_split_ag=g.tp_comm_split_ag,
        tp_comm_split_rs=g.tp_comm_split_rs,
        tp_comm_bootstrap_backend=g.tp_comm_bootstrap_backend,
        overlap_moe_expert_parallel_comm=g.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=g.delay_wgrad_compute,
        ep_overlap_early_attn_memory_release=g.ep_overlap_early_attn_memory_release,
        fine_grained_activation_offloading=g.fine_grained_activation_offloading,
        offload_modules=list(g.offload_modules),
        min_offloaded_tensor_size=g.min_offloaded_tensor_size,
        cuda_graph_impl=g.cuda_graph_impl,
        cuda_graph_scope=list(g.cuda_graph_scope),
        cuda_graph_warmup_steps=g.cuda_graph_warmup_steps,
    )


def latent_attention_settings(config: Config) -> dict:
    """MLA's fields (none without it: other attention's rotary embedding is
    rope, the only --rope-type it takes); without --rope-type megatron-core's
    default (yarn), as Megatron-LM."""
    m = config.model
    if not m.multi_latent_attention:
        return {}
    return dict(
        {} if m.rope_type is None else {"rope_type": m.rope_type},
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_head_dim=m.qk_head_dim,
        qk_pos_emb_head_dim=m.qk_pos_emb_head_dim,
        v_head_dim=m.v_head_dim,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        rotary_scaling_factor=m.rotary_scaling_factor,
        mscale=m.mscale,
        mscale_all_dim=m.mscale_all_dim,
    )


def activation(config: Config):
    m = config.model
    return F.silu if m.swiglu else squared_relu if m.squared_relu else F.gelu


def fusion_settings(config: Config, on_cpu: bool) -> dict:
    """megatron-core's fusions a run asks for (Megatron-LM's --no-*-fusion
    flags) where their kernels exist: none on a CPU.
    - bias and GeLU: only where the linear layers have a bias (megatron-core
      refuses the fusion without one, as Megatron-LM turns it off); bias and
      SwiGLU with a bias or without; squared ReLU has no fused kernel.
    - rotary embeddings: Transformer Engine's kernel.
    - weight-gradient accumulation: Transformer Engine's layers, or Apex's
      kernel under the local ones."""
    m, t = config.model, config.training
    if on_cpu:
        return dict(
            bias_activation_fusion=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
        )
    te = use_transformer_engine(config, on_cpu)
    if m.swiglu:
        fuse_activation = m.bias_swiglu_fusion
    else:
        fuse_activation = not m.squared_relu and m.bias_gelu_fusion and not m.disable_bias_linear
    return dict(
        bias_activation_fusion=fuse_activation,
        apply_rope_fusion=m.apply_rope_fusion and m.position_embedding_type == "rope" and te,
        gradient_accumulation_fusion=t.gradient_accumulation_fusion
        and (te or apex_gradient_fusion_built()),
    )


def apex_gradient_fusion_built() -> bool:
    """Apex's weight-gradient accumulation kernel (the local layers' fusion)."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def layer_norm_can_persist(config: Config) -> bool:
    """Megatron-LM's persistent layer norm where the layer norm has one: Transformer
    Engine's, or Apex's in the local spec. Without either megatron-core builds
    torch's LayerNorm, which refuses it (seen on an H200 without Apex)."""
    apex = importlib.util.find_spec("apex") is not None
    return use_transformer_engine(config, on_cpu=False) or apex


def softmax_kernel_built() -> bool:
    """Megatron's fused scale-mask-softmax kernel, built by Apex or Transformer
    Engine's install: megatron-core imports it at the first forward and fails
    without it (seen on an H200 without either), so without it the softmax is
    torch's, as with --no-masked-softmax-fusion."""
    return importlib.util.find_spec("scaled_masked_softmax_cuda") is not None


def recompute_settings(config: Config) -> dict:
    """megatron-core's activation-recompute fields (its defaults unless given)."""
    t = config.training
    settings = dict(
        recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        distribute_saved_activations=t.distribute_saved_activations,
    )
    if t.recompute_modules is not None:
        settings["recompute_modules"] = t.recompute_modules
    return settings


def moe_settings(config: Config) -> dict:
    """megatron-core's MoE fields (none for a dense model)."""
    moe, p = config.moe, config.parallel
    if moe.num_experts is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.moe_ffn_hidden_size,
        moe_router_topk=moe.moe_router_topk,
        moe_router_load_balancing_type=moe.moe_router_load_balancing_type,
        moe_aux_loss_coeff=moe.moe_aux_loss_coeff,
        moe_z_loss_coeff=moe.moe_z_loss_coeff,
        moe_input_jitter_eps=moe.moe_input_jitter_eps,
        moe_router_score_function=moe.moe_router_score_function,
        moe_router_pre_softmax=moe.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=moe.moe_router_topk_scaling_factor,
        moe_token_dispatcher_type=moe.moe_token_dispatcher_type,
        moe_flex_dispatcher_backend=moe.moe_flex_dispatcher_backend,
        moe_enable_deepep=moe.moe_enable_deepep,
        moe_grouped_gemm=moe.moe_grouped_gemm,
        moe_expert_capacity_factor=moe.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=moe.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=moe.moe_token_drop_policy,
        moe_shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
        moe_per_layer_logging=moe.moe_per_layer_logging,
        moe_router_dtype=moe.moe_router_dtype,
        moe_layer_freq=moe.moe_layer_freq,
        moe_router_num_groups=moe.moe_router_num_groups,
        moe_router_group_topk=moe.moe_router_group_topk,
        moe_router_enable_expert_bias=moe.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=moe.moe_router_bias_update_rate,
        # Transformer Engine's kernels (arguments.py refuses them off a GPU)
        moe_permute_fusion=moe.moe_permute_fusion,
        moe_router_fusion=moe.moe_router_fusion,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
    )


class HookedDistributedDataParallel(DistributedDataParallel):
    """megatron-core's DDP with one hook point more: callbacks run just
    before the parameter all-gather starts, which the distributed optimizer
    starts right after it updated its shard (inside ``optimizer.step()``),
    once per iteration."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._param_sync_hooks: List[Callable[[], None]] = []

    def register_param_sync_hook(self, hook: Callable[[], None]) -> None:
        self._param_sync_hooks.append(hook)

    def start_param_sync(self, *args, force_sync: bool = False, force_dispatch: bool = False):
        # Started from the optimizer's step (--overlap-param-gather-with-
        # optimizer-step), the chunk's later calls start nothing: no hook.
        if force_sync or force_dispatch or not self.overlap_param_gather_with_optimizer_step:
            for hook in self._param_sync_hooks:
                hook()
        return super().start_param_sync(*args, force_sync=force_sync, force_dispatch=force_dispatch)


def reduce_grads_in_fp32(config: Config) -> bool:
    """As Megatron-LM: fp32 gradients with --bf16 unless --grad-reduce-in-bf16;
    otherwise only with --accumulate-allreduce-grads-in-fp32 (fp32 training
    has fp32 gradients anyway)."""
    t = config.training
    if t.bf16:
        return not t.grad_reduce_in_bf16
    return t.accumulate_allreduce_grads_in_fp32


def wrap_model(
    module: torch.nn.Module, tf_config: TransformerConfig, config: Config, chunk: int = 0
) -> DistributedDataParallel:
    """Half-precision wrapper when needed, then megatron-core's DDP. As
    Megatron-LM, a pipeline rank's model chunks after the first keep their
    gradients in one bucket (their reduction overlaps compute anyway)."""
    if config.training.bf16 or config.training.fp16:
        module = Float16Module(tf_config, module)
    p = config.parallel
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=reduce_grads_in_fp32(config),
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
        num_distributed_optimizer_instances=p.num_distributed_optimizer_instances,
        average_in_collective=p.ddp_average_in_collective,
        check_for_nan_in_grad=config.training.check_for_nan_in_loss_and_grad,
    )
    # With the first chunk's all-gather started from the optimizer's step,
    # that chunk's is one bucket too (as Megatron-LM).
    one_bucket = chunk > 0 or p.overlap_param_gather_with_optimizer_step
    model = HookedDistributedDataParallel(
        config=tf_config, ddp_config=ddp_config, module=module, disable_bucketing=one_bucket
    )
    # Megatron broadcasts params from DP rank 0 so replicas start equal even
    # if their initialisation differed.
    model.broadcast_params()
    return model


def build_optimizer(model: List[DistributedDataParallel], config: Config):
    t, p = config.training, config.parallel
    opt_config = OptimizerConfig(
        optimizer=t.optimizer,
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        sgd_momentum=t.sgd_momentum,
        clip_grad=t.clip_grad,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=params_dtype(config),
        loss_scale=t.loss_scale,
        initial_loss_scale=t.initial_loss_scale,
        min_loss_scale=t.min_loss_scale,
        loss_scale_window=t.loss_scale_window,
        hysteresis=t.hysteresis,
        use_distributed_optimizer=p.use_distributed_optimizer,
        overlap_param_gather=p.overlap_param_gather,
        overlap_param_gather_with_optimizer_step=p.overlap_param_gather_with_optimizer_step,
        decoupled_lr=t.decoupled_lr,
        decoupled_min_lr=t.decoupled_min_lr,
        log_num_zeros_in_grad=config.logging.log_num_zeros_in_grad,
    )
    return get_megatron_optimizer(opt_config, model, use_gloo_process_groups=False)


def build_scheduler(optimizer, config: Config) -> OptimizerParamScheduler:
    t, steps = config.training, schedule_in_samples(config)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=t.lr_warmup_init,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=steps["warmup"],
        lr_decay_steps=steps["decay"],
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=steps["total"],
        wd_incr_style="constant",
        wsd_decay_steps=steps["wsd"],
        lr_wsd_decay_style=t.lr_wsd_decay_style,
        # A loaded checkpoint's schedule wins unless --override-opt_param-scheduler.
        use_checkpoint_opt_param_scheduler=not config.checkpoint.override_opt_param_scheduler,
        override_opt_param_scheduler=config.checkpoint.override_opt_param_scheduler,
    )


@dataclass
class TrainState:
    """The objects one training run mutates."""

    model: List[DistributedDataParallel]
    optimizer: object
    scheduler: OptimizerParamScheduler
    tf_config: TransformerConfig


# (config, tf_config, pre_process, post_process[, vp_stage=]) -> this rank's
# module; vp_stage (the model chunk) is passed only with virtual stages.
ModelProvider = Callable[..., torch.nn.Module]


def chunk_ends(chunks: int) -> List[Tuple[bool, bool]]:
    """Per model chunk of this pipeline rank, whether it is the first stage
    (embeds the tokens) and the last (computes the loss), virtual stages
    counted: chunk v of pipeline rank r is virtual stage v x PP + r."""
    if chunks == 1:
        return [(parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())]
    return [
        (
            parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
        )
        for v in range(chunks)
    ]


def build_chunks(config: Config, tf_config: TransformerConfig, model_provider) -> list:
    """This pipeline rank's modules: its stage, or with virtual pipeline
    stages one chunk per virtual stage (Megatron-LM's get_model)."""
    if config.model_chunks == 1:
        ((pre, post),) = chunk_ends(1)
        return [model_provider(config, tf_config, pre, post)]
    chunks = []
    for stage, (pre, post) in enumerate(chunk_ends(config.model_chunks)):
        module = model_provider(config, tf_config, pre, post, vp_stage=stage)
        module.vp_stage = stage
        chunks.append(module)
    return chunks


def setup_model_and_optimizer(
    config: Config, model_provider: ModelProvider, on_cpu: bool
) -> TrainState:
    """Build this rank's model chunks, wrap them, and attach optimizer hooks."""
    tf_config = transformer_config(config, on_cpu)
    modules = build_chunks(config, tf_config, model_provider)
    if config.model.layout_invariant_init:
        m = config.model
        for stage, module in enumerate(modules):
            layout_invariant_init.apply(
                module,
                config.training.seed,
                m.init_method_std,
                m.num_layers,
                not m.untie_embeddings_and_output_weights,
                m.swiglu,
                layer_offset=get_transformer_layer_offset(
                    tf_config, vp_stage=stage if len(modules) > 1 else None
                ),
            )
    model = [wrap_model(module, tf_config, config, chunk) for chunk, module in enumerate(modules)]
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    _attach_schedule_hooks(model, optimizer, tf_config, config)
    return TrainState(model=model, optimizer=optimizer, scheduler=scheduler, tf_config=tf_config)


def _attach_schedule_hooks(model, optimizer, tf_config, config) -> None:
    """What the pipeline schedules call back into: loss scaling, grad sync."""
    tf_config.grad_scale_func = optimizer.scale_loss
    # Without this, DP and tied-embedding gradients are never reduced.
    tf_config.finalize_model_grads_func = finalize_model_grads
    if config.parallel.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        tf_config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
