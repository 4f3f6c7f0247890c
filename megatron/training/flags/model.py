"""Checks of the model's shape and features.

Sizes that divide over the tensor-parallel ranks, activations, position
embeddings, attention (its backend, multi-latent attention), the layers'
kernels, multi-token prediction."""

import dataclasses

from megatron.training.attention import (
    attention_masked_by,
    attention_problem,
    local_attention_lacks,
)
from megatron.training.config import Config, ModelConfig
from megatron.training.flags import host
from megatron.training.flags.refusal import flag_name, ignored_without, require, warn


def check_shape(config: Config) -> None:
    m, p = config.model, config.parallel
    tp = p.tensor_model_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        require(getattr(m, name) > 0, f"--{name.replace('_', '-')} must be positive")
    require(
        m.num_attention_heads % tp == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by "
        f"--tensor-model-parallel-size {tp}: choose heads as a multiple of {tp}",
    )
    require(
        m.kv_channels is not None or m.hidden_size % m.num_attention_heads == 0,
        f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
        f"{m.num_attention_heads}: change one of them or set --kv-channels",
    )
    require(
        m.num_attention_heads % m.num_query_groups == 0,
        f"--num-attention-heads {m.num_attention_heads} is not divisible by "
        f"--num-query-groups {m.num_query_groups}",
    )
    require(
        m.num_query_groups % tp == 0,
        f"--num-query-groups {m.num_query_groups} is not divisible by "
        f"--tensor-model-parallel-size {tp}",
    )
    require(
        m.position_embedding_type != "learned_absolute"
        or m.max_position_embeddings >= m.seq_length,
        f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
        f"{m.max_position_embeddings}: raise --max-position-embeddings",
    )
    require(
        m.transformer_impl != "transformer_engine" or host.importable("transformer_engine"),
        "--transformer-impl transformer_engine needs the transformer_engine package: "
        "install it or use --transformer-impl local",
    )


def check_features(config: Config) -> None:
    m = config.model
    _check_sequence_parallel(config)
    _check_wgrad_deferral(config)
    require(
        not (m.squared_relu and m.swiglu),
        "--squared-relu and --swiglu are two activations: give one",
    )
    require(
        m.position_embedding or m.position_embedding_type == "rope",
        "--no-position-embedding is deprecated (as in Megatron-LM): use "
        "--position-embedding-type rope",
    )
    require(0 < m.rotary_percent <= 1, f"--rotary-percent {m.rotary_percent} must be in (0, 1]")
    ignored_without(
        "--position-embedding-type rope",
        m.position_embedding_type == "rope",
        [("--rotary-interleaved", m.rotary_interleaved)],
    )
    if m.use_rotary_position_embeddings:
        warn("--use-rotary-position-embeddings is deprecated: use --position-embedding-type rope")
    if not config.parallel.async_tensor_model_parallel_allreduce:
        warn(
            "--no-async-tensor-model-parallel-allreduce has no effect: megatron-core "
            "ignores it (deprecated in Megatron-LM)"
        )
    if m.use_flash_attn:
        warn(
            "--use-flash-attn has no effect: Megatron-LM reads it in its legacy models only; "
            "--attention-backend flash chooses flash attention"
        )
    _check_pipeline_overlap(config)
    uses_te = host.uses_transformer_engine(config)
    on_gpu = config.parallel.distributed_backend == "nccl"
    _check_latent_attention(config, on_gpu)
    require(
        not m.apply_layernorm_1p or uses_te or (on_gpu and host.importable("apex")),
        "--apply-layernorm-1p needs Transformer Engine's or Apex's LayerNorm (torch's has "
        "no zero-centred weights), on a GPU: drop it here",
    )
    require(
        m.cross_entropy_fusion_impl == "native" or m.cross_entropy_loss_fusion,
        "--cross-entropy-fusion-impl goes with --cross-entropy-loss-fusion: add it, or drop it",
    )
    require(
        m.cross_entropy_fusion_impl == "native" or uses_te,
        "--cross-entropy-fusion-impl te is Transformer Engine's kernel, which needs a GPU "
        "with the transformer_engine package: use native here",
    )
    problem = attention_problem(
        m.attention_backend,
        uses_te,
        on_cpu=not on_gpu,
        dropout=m.attention_dropout,
        masked_by=attention_masked_by(config),
        local_lacks=local_attention_lacks(config),
    )
    require(problem is None, problem or "")
    p = config.parallel
    comm_given = p.cp_comm_type != ["p2p"] or p.hierarchical_context_parallel_sizes is not None
    cp_flags = [("--cp-comm-type, --hierarchical-context-parallel-sizes", comm_given)]
    ignored_without("--context-parallel-size > 1", p.context_parallel_size > 1, cp_flags)
    if comm_given and p.context_parallel_size > 1 and not uses_te:
        warn(
            "--cp-comm-type and --hierarchical-context-parallel-sizes choose Transformer "
            "Engine's context-parallel communication; without it (torch SDPA) keys and values "
            "are gathered from the whole context-parallel group, the same result"
        )


def _check_pipeline_overlap(config: Config) -> None:
    p = config.parallel
    require(
        not p.overlap_p2p_comm_warmup_flush or p.overlap_p2p_comm,
        "--overlap-p2p-communication-warmup-flush goes with the interleaved schedule's "
        "overlapped sends and receives (virtual stages, without "
        "--no-overlap-p2p-communication): drop it, or give virtual stages",
    )
    require(
        not (p.ddp_average_in_collective and config.training.calculate_per_token_loss),
        "--ddp-average-in-collective averages over the ranks, --calculate-per-token-loss "
        "divides by the batch's tokens: give one",
    )


def _check_wgrad_deferral(config: Config) -> None:
    """megatron-core's rules for --defer-embedding-wgrad-compute, checked now."""
    t, p = config.training, config.parallel
    limit = [("--wgrad-deferral-limit", t.wgrad_deferral_limit != 0)]
    ignored_without("--defer-embedding-wgrad-compute", t.defer_embedding_wgrad_compute, limit)
    if not t.defer_embedding_wgrad_compute:
        return
    require(
        p.pipeline_model_parallel_size > 1,
        "--defer-embedding-wgrad-compute defers to the pipeline's flush: it needs "
        "--pipeline-model-parallel-size > 1",
    )
    fused = (
        p.distributed_backend == "nccl"
        and t.gradient_accumulation_fusion
        and (
            host.uses_transformer_engine(config)
            or host.importable("fused_weight_gradient_mlp_cuda")
        )
    )
    require(
        fused,
        "--defer-embedding-wgrad-compute needs gradient-accumulation fusion: Transformer "
        "Engine's layers or Apex's kernel, on a GPU, without --no-gradient-accumulation-fusion",
    )
    require(t.wgrad_deferral_limit >= 0, "--wgrad-deferral-limit must be >= 0")


def _check_sequence_parallel(config: Config) -> None:
    on_gpu = config.parallel.distributed_backend == "nccl"
    require(
        not config.parallel.sequence_parallel
        or host.uses_transformer_engine(config)
        or (on_gpu and host.importable("apex")),
        "--sequence-parallel needs Transformer Engine's or Apex's norm layers (torch's "
        "LayerNorm and RMSNorm cannot gather sequence-parallel gradients), on a GPU: drop it "
        "here",
    )


def _check_latent_attention(config: Config, on_gpu: bool) -> None:
    """Multi-latent attention's rules (Megatron-LM's, and what megatron-core
    runs here); its flags mean nothing without it."""
    m = config.model
    fields = {f.name: f for f in dataclasses.fields(m)}
    sizes = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    yarn = ("rotary_scaling_factor", "mscale", "mscale_all_dim")
    ignored_without(
        "--multi-latent-attention",
        m.multi_latent_attention,
        [(flag_name(fields[n]), getattr(m, n) != fields[n].default) for n in sizes + yarn],
    )
    require(
        m.multi_latent_attention or m.rope_type in (None, "rope"),
        f"--rope-type {m.rope_type} is multi-latent attention's: other attention takes rope "
        "only (add --multi-latent-attention, or drop --rope-type)",
    )
    if not m.multi_latent_attention:
        return
    require(
        not m.group_query_attention,
        "--multi-latent-attention and --group-query-attention exclude each other (MLA's keys "
        "and values come from a low-rank projection of their own): drop one",
    )
    given = [(flag_name(fields[n]), getattr(m, n)) for n in sizes]
    small = [f"{flag} {size}" for flag, size in given if size is not None and size < 1]
    require(not small, f"{', '.join(small)}: multi-latent attention's sizes must be >= 1")
    require(
        on_gpu or config.parallel.context_parallel_size == 1,
        "--multi-latent-attention with --context-parallel-size > 1: megatron-core's rotary "
        "embedding then pins host memory, which needs a GPU: use --context-parallel-size 1 here",
    )


def check_multi_token_prediction(config: Config) -> None:
    m = config.model
    factor = ModelConfig.__dataclass_fields__["mtp_loss_scaling_factor"].default
    if m.mtp_num_layers is None:
        ignored_without(
            "--mtp-num-layers",
            False,
            [("--mtp-loss-scaling-factor", m.mtp_loss_scaling_factor != factor)],
        )
        return
    require(m.mtp_num_layers > 0, f"--mtp-num-layers {m.mtp_num_layers} must be positive")
    require(
        m.position_embedding_type == "rope",
        "multi-token prediction needs --position-embedding-type rope (Megatron-LM's rule: "
        "its layers take no learned position embedding)",
    )
    require(
        m.untie_embeddings_and_output_weights or config.parallel.pipeline_model_parallel_size == 1,
        "multi-token prediction on a pipeline needs --untie-embeddings-and-output-weights "
        "(as every Megatron-LM MTP config): megatron-core 0.16 keeps an unused output "
        "weight on the MTP stage with tied ones, and refuses to save it",
    )
