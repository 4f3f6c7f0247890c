"""Training configuration as dataclasses; the command-line flags are generated
from them (see ``arguments.py``).

Each field's name is its flag (``num_layers`` -> ``--num-layers``) and its
``help`` metadata is the flag's help text. Names and defaults follow
Megatron-LM's ``pretrain_gpt.py`` so users can type them from memory.
A field marked ``required`` must be given; ``choices`` limit the values;
``flag`` overrides the generated name.
"""

import argparse
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Type, TypeVar, Union

# The file in a checkpoint directory that names its latest save (Megatron-LM's).
TRACKER = "latest_checkpointed_iteration.txt"


def split_numbers(split: str) -> List[str]:
    """The numbers of --split as megatron-core reads them: whatever stands
    between them (commas, slashes, the quotes of Megatron-LM's Llama-3
    script's '99,1,0') is a separator."""
    return re.findall(r"[.0-9]+", split)


def layer_pattern(text: str) -> Union[int, List[int]]:
    """--moe-layer-freq's value as Megatron-LM reads it: N (an MoE layer
    every N layers, from the first) or a list expression of 0s and 1s, such
    as ``([0]*3+[1]*11)`` (a dense layer for each 0, an MoE layer for each 1).
    Only digits, brackets, commas, + and * are evaluated."""
    text = str(text).strip()
    if not re.fullmatch(r"[0-9\[\]()+*, ]+", text):
        raise argparse.ArgumentTypeError(
            f"not a layer frequency or pattern of 0s and 1s: {text!r} (e.g. 2, or '([0]*1+[1]*3)')"
        )
    if "[" not in text:
        return int(text)
    pattern = eval(text, {"__builtins__": {}})  # the characters above: list arithmetic only
    if not isinstance(pattern, list) or any(v not in (0, 1) for v in pattern):
        raise argparse.ArgumentTypeError(f"a layer pattern lists 0s (dense) and 1s (MoE): {text!r}")
    return pattern


def moe_layer_pattern(config: "Config") -> List[int]:
    """1 for each MoE layer, 0 for each dense one, in order (--moe-layer-freq;
    all dense without --num-experts)."""
    layers, freq = config.model.num_layers, config.moe.moe_layer_freq
    if config.moe.num_experts is None:
        return [0] * layers
    if isinstance(freq, list):
        return list(freq)
    return [int(i % freq == 0) for i in range(layers)]


def layout_stages(layout: str) -> list:
    """--pipeline-model-parallel-layout's stages as megatron-core reads them,
    each a list of layer types (megatron-core's parser: imported only when
    the flag is given)."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import (
        PipelineParallelLayerLayout,
    )

    return PipelineParallelLayerLayout.parse_str_to_list(layout)


def arg(default=None, help="", **meta):
    """A config field with its flag's help text and options in metadata."""
    kwargs = {"metadata": {"help": help, **meta}}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), **kwargs)
    return field(default=default, **kwargs)


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the GPT model."""

    num_layers: Optional[int] = arg(help="Number of transformer layers.", required=True)
    hidden_size: Optional[int] = arg(help="Transformer hidden size.", required=True)
    num_attention_heads: Optional[int] = arg(help="Number of attention heads.", required=True)
    ffn_hidden_size: Optional[int] = arg(
        help="MLP hidden size (default 4*hidden, or int(8h/3/64)*64 with --swiglu)."
    )
    kv_channels: Optional[int] = arg(help="Projection size per head (default hidden/heads).")
    seq_length: Optional[int] = arg(help="Training sequence length.", required=True)
    max_position_embeddings: Optional[int] = arg(
        help="Size of the position embedding table (default --seq-length)."
    )
    position_embedding_type: str = arg(
        "learned_absolute", help="Position embedding.", choices=["learned_absolute", "rope"]
    )
    rotary_base: int = arg(10000, help="Base of the rotary embedding.")
    rotary_percent: float = arg(1.0, help="Share of each head's dimensions that rotate (rope).")
    position_embedding: bool = arg(
        True,
        flag="--no-position-embedding",
        help="Deprecated in Megatron-LM: accepted with --position-embedding-type rope only.",
    )
    use_rotary_position_embeddings: bool = arg(
        False, help="Deprecated in Megatron-LM: the same as --position-embedding-type rope."
    )
    use_mcore_models: bool = arg(
        False, help="Deprecated in Megatron-LM: megatron-core's models are the only ones here."
    )
    attention_backend: str = arg(
        "auto",
        help="Core attention: Transformer Engine's flash, fused or unfused where it is "
        "used, else torch's scaled_dot_product_attention with those kernels; local is "
        "megatron-core's; auto lets TE or torch choose (megatron-core's on a CPU).",
        choices=["flash", "fused", "unfused", "local", "auto"],
    )
    cross_entropy_loss_fusion: bool = arg(
        False, help="Fused cross entropy of the output layer (megatron-core's kernel)."
    )
    cross_entropy_fusion_impl: str = arg(
        "native",
        help="The fused cross entropy's implementation: megatron-core's (native) or "
        "Transformer Engine's (te, on a GPU).",
        choices=["native", "te"],
    )
    apply_layernorm_1p: bool = arg(
        False,
        help="LayerNorm weights centred on zero (stored as gamma - 1); needs Transformer "
        "Engine's or Apex's LayerNorm (a GPU).",
    )
    masked_softmax_fusion: bool = arg(
        True,
        flag="--no-masked-softmax-fusion",
        help="Do not fuse scaling, masking and softmax (the fused kernel needs a GPU).",
    )
    make_vocab_size_divisible_by: int = arg(
        128, help="Pad the vocabulary to a multiple of this (times TP)."
    )
    normalization: str = arg("LayerNorm", help="Norm layer.", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = arg(1e-5, help="Epsilon of the norm layers.")
    hidden_dropout: float = arg(0.1, help="Dropout after attention and MLP.")
    attention_dropout: float = arg(0.1, help="Dropout on attention probabilities.")
    init_method_std: float = arg(0.02, help="Standard deviation of weight init.")
    swiglu: bool = arg(False, help="Use SwiGLU in the MLP.")
    disable_bias_linear: bool = arg(False, help="No biases in linear layers.")
    untie_embeddings_and_output_weights: bool = arg(
        False, help="Separate input embedding and output layer weights."
    )
    group_query_attention: bool = arg(False, help="Use grouped-query attention.")
    num_query_groups: int = arg(1, help="Query groups with --group-query-attention.")
    multi_latent_attention: bool = arg(
        False,
        help="Multi-latent attention (DeepSeek's MLA): queries, keys and values from "
        "low-rank projections, rotary embeddings on a part of each head of their own.",
    )
    q_lora_rank: Optional[int] = arg(
        help="MLA: rank of the queries' low-rank projection (default: none, a full one)."
    )
    kv_lora_rank: int = arg(32, help="MLA: rank of the keys' and values' low-rank projection.")
    qk_head_dim: int = arg(128, help="MLA: head dimension of queries and keys without rope.")
    qk_pos_emb_head_dim: int = arg(
        64, help="MLA: head dimension of queries and keys that takes the rotary embedding."
    )
    v_head_dim: int = arg(128, help="MLA: head dimension of the values.")
    rope_type: Optional[str] = arg(
        help="Rotary embedding kind: MLA's default is yarn, other attention takes rope only.",
        choices=["rope", "yarn"],
    )
    rotary_scaling_factor: float = arg(1.0, help="MLA: YaRN's rotary scaling factor.")
    mscale: float = arg(1.0, help="MLA: YaRN's mscale.")
    mscale_all_dim: float = arg(0.0, help="MLA: YaRN's mscale over all dimensions.")
    mtp_num_layers: Optional[int] = arg(
        help="Multi-token prediction (DeepSeek-V3): this many extra layers after the last "
        "stage, each predicting one token further ahead (none: no MTP)."
    )
    mtp_loss_scaling_factor: float = arg(
        0.1, help="MTP: weight of the mean of the MTP layers' losses added to the LM loss."
    )
    layout_invariant_init: bool = arg(
        False,
        help="Draw each parameter's full tensor from a seed of its global name, so "
        "every TP/PP/DP layout starts from the same weights (verification, small models).",
    )
    transformer_impl: str = arg(
        "auto",
        help="Layer implementation: Transformer Engine when importable on a GPU "
        "(auto), or megatron-core's local layers.",
        choices=["auto", "local", "transformer_engine"],
    )
    qk_layernorm: bool = arg(False, help="Normalize queries and keys (the --normalization kind).")
    add_qkv_bias: bool = arg(
        False, help="Bias in the query-key-value projection only (with --disable-bias-linear)."
    )
    squared_relu: bool = arg(
        False, help="Squared ReLU as the MLP's activation (not with --swiglu)."
    )
    attention_softmax_in_fp32: bool = arg(
        False, help="Attention softmax in fp32 where the scores are fp16 or bf16."
    )
    apply_query_key_layer_scaling: bool = arg(
        False,
        help="Scale Q x K^T by 1 / layer number (fp16; also turns on --attention-softmax-in-fp32).",
    )
    bias_gelu_fusion: bool = arg(
        True,
        flag="--no-bias-gelu-fusion",
        help="Do not fuse the bias and GeLU (fused on a GPU, where the linear layers have bias).",
    )
    bias_swiglu_fusion: bool = arg(
        True,
        flag="--no-bias-swiglu-fusion",
        help="Do not fuse the bias and SwiGLU (fused on a GPU).",
    )
    apply_rope_fusion: bool = arg(
        True,
        flag="--no-rope-fusion",
        help="Do not fuse rotary embeddings (fused only with Transformer Engine on a GPU).",
    )
    rotary_interleaved: bool = arg(
        False, help="Rotate interleaved pairs of a head's dimensions (default: its two halves)."
    )
    no_persist_layer_norm: bool = arg(
        False,
        help="Do not use the persistent fused layer-norm kernel (Apex's or Transformer "
        "Engine's, on a GPU).",
    )
    use_flash_attn: bool = arg(
        False,
        help="Read by Megatron-LM's legacy models only: no effect here (a warning says so); "
        "--attention-backend flash chooses flash attention.",
    )
    test_mode: bool = arg(
        False,
        help="megatron-core's real-time checks: with --qk-layernorm every forward compares "
        "the Q and K layer norms' weights over the data-parallel ranks.",
    )


@dataclass(kw_only=True)
class ParallelConfig:
    """How ranks are split between tensor, pipeline and data parallelism."""

    tensor_model_parallel_size: int = arg(1, help="Tensor-parallel size.")
    pipeline_model_parallel_size: int = arg(1, help="Pipeline-parallel size.")
    sequence_parallel: bool = arg(False, help="Sequence parallelism (needs TP > 1).")
    num_layers_per_virtual_pipeline_stage: Optional[int] = arg(
        help="Layers per virtual pipeline stage: each pipeline rank holds several model "
        "chunks and runs the interleaved schedule."
    )
    num_virtual_stages_per_pipeline_rank: Optional[int] = arg(
        help="Model chunks (virtual stages) per pipeline rank, for the interleaved schedule "
        "(instead of --num-layers-per-virtual-pipeline-stage)."
    )
    pipeline_model_parallel_layout: Optional[str] = arg(
        help="Which layers each pipeline stage holds, e.g. 'Et*3|(tt|)*6mL': E the "
        "embedding, t a transformer layer, m an MTP layer, L the loss; '|' ends a stage, "
        "*N repeats; more stages than --pipeline-model-parallel-size are virtual stages "
        "(stage i on pipeline rank i mod PP)."
    )
    async_tensor_model_parallel_allreduce: bool = arg(
        True,
        flag="--no-async-tensor-model-parallel-allreduce",
        aliases=("--disable-async-tensor-model-parallel-allreduce",),
        help="Deprecated in Megatron-LM, no effect (megatron-core ignores it).",
    )
    decoder_first_pipeline_num_layers: Optional[int] = arg(
        help="Transformer layers on the first pipeline stage (default: an even split); "
        "the stages between the first and the last share the rest evenly."
    )
    decoder_last_pipeline_num_layers: Optional[int] = arg(
        help="Transformer layers on the last pipeline stage (default: an even split)."
    )
    account_for_embedding_in_pipeline_split: bool = arg(
        False,
        help="Count the input embedding as a layer of the first stage when splitting the "
        "layers between pipeline stages.",
    )
    account_for_loss_in_pipeline_split: bool = arg(
        False,
        help="Count the output layer and loss as a layer of the last stage when splitting "
        "the layers between pipeline stages.",
    )
    microbatch_group_size_per_vp_stage: Optional[int] = arg(
        flag="--microbatch-group-size-per-virtual-pipeline-stage",
        help="Microbatches a virtual stage runs in a row in the interleaved schedule "
        "(default --pipeline-model-parallel-size).",
    )
    overlap_p2p_comm: bool = arg(
        True,
        flag="--no-overlap-p2p-communication",
        help="Batch the interleaved schedule's sends and receives instead of overlapping "
        "them with compute (then PP must be > 2); without virtual stages it is off.",
    )
    overlap_p2p_comm_warmup_flush: bool = arg(
        False,
        flag="--overlap-p2p-communication-warmup-flush",
        help="Overlap the interleaved schedule's sends and receives in its warm-up and "
        "flush phases too.",
    )
    context_parallel_size: int = arg(
        1,
        help="Context-parallel size: each sequence is split over this many ranks, "
        "which attend to each other's keys and values (not with --deadpool yet).",
    )
    cp_comm_type: List[str] = arg(
        ["p2p"],
        help="Transformer Engine's context-parallel communication (p2p, a2a, allgather, "
        "a2a+p2p; one per layer or one for all); torch SDPA's gathers keys and values.",
    )
    hierarchical_context_parallel_sizes: Optional[List[int]] = arg(
        help="The context-parallel group's levels for --cp-comm-type a2a+p2p (their "
        "product is --context-parallel-size).",
    )
    use_distributed_optimizer: bool = arg(
        False, help="Shard optimizer state over data-parallel ranks."
    )
    num_distributed_optimizer_instances: int = arg(
        1,
        help="Copies of the distributed optimizer across the data-parallel ranks: each "
        "shards its state over a part of them, and the parts all-reduce gradients (not "
        "with --deadpool yet).",
    )
    overlap_grad_reduce: bool = arg(False, help="Overlap gradient reduce with backward.")
    ddp_average_in_collective: bool = arg(
        False,
        help="Average gradients in the data-parallel collective itself instead of scaling "
        "them before a sum.",
    )
    overlap_param_gather: bool = arg(
        False, help="Overlap parameter all-gather with forward (distributed optimizer)."
    )
    overlap_param_gather_with_optimizer_step: bool = arg(
        False,
        help="Start the first model chunk's parameter all-gather as soon as its optimizer "
        "has stepped, overlapping the other chunks' steps (interleaved schedule, "
        "--overlap-param-gather, --ckpt-format torch).",
    )
    use_tp_pp_dp_mapping: bool = arg(
        False,
        help="Number ranks tp fastest, then pp, then dp (default: tp, dp, pp), so a "
        "data-parallel replica fills whole nodes and DP peers sit on other nodes.",
    )
    distributed_backend: str = arg(
        "nccl",
        help="Backend; gloo is used instead of nccl when there is no GPU.",
        choices=["nccl", "gloo"],
    )
    expert_model_parallel_size: int = arg(
        1, help="Expert-parallel size: the MoE layers' experts are split over this many ranks."
    )
    expert_tensor_parallel_size: Optional[int] = arg(
        help="Tensor-parallel size within each expert (default --tensor-model-parallel-size)."
    )
    distributed_timeout_minutes: float = arg(10, help="Timeout of collectives, minutes.")
    enable_gloo_process_groups: bool = arg(
        True,
        flag="--disable-gloo-process-groups",
        help="Megatron-LM's gloo twins of the data-parallel groups: never made here (saves "
        "and mirrors do not use them), with or without this flag.",
    )
    cpu: bool = arg(False, help="Run on CPU with gloo even when a GPU is present.")


# Megatron-LM's names for --moe-router-load-balancing-type.
LOAD_BALANCING_TYPES = ["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture of experts: megatron-core's MoE layers in place of the MLP."""

    num_experts: Optional[int] = arg(help="Experts per MoE layer (none: a dense model).")
    moe_ffn_hidden_size: Optional[int] = arg(
        help="Hidden size of each expert's MLP (default --ffn-hidden-size)."
    )
    moe_router_topk: int = arg(2, help="Experts each token is routed to.")
    moe_router_load_balancing_type: str = arg(
        "aux_loss",
        help="Load balancing: aux_loss (GShard/Switch), seq_aux_loss (per sequence), "
        "global_aux_loss, sinkhorn (S-BASE), none; several with their coefficients.",
        choices=LOAD_BALANCING_TYPES,
        nargs="+",
    )
    moe_aux_loss_coeff: float = arg(
        0.0, help="Weight of the auxiliary load-balancing loss (one per type).", nargs="+"
    )
    moe_z_loss_coeff: Optional[float] = arg(help="Weight of the router's z-loss.")
    moe_input_jitter_eps: Optional[float] = arg(
        help="Multiply the router's input by uniform noise in [1 - eps, 1 + eps]."
    )
    moe_router_score_function: str = arg(
        "softmax", help="Router scores: softmax or sigmoid.", choices=["softmax", "sigmoid"]
    )
    moe_router_pre_softmax: bool = arg(
        False, help="Softmax over all experts before the top-k (default: after it)."
    )
    moe_router_topk_scaling_factor: Optional[float] = arg(
        help="Scale the top-k routing probabilities by this."
    )
    moe_token_dispatcher_type: str = arg(
        "allgather",
        help="How tokens reach their experts: allgather, alltoall, or flex (DeepEP's or "
        "HybridEP's kernels, on GPUs).",
        choices=["allgather", "alltoall", "flex"],
    )
    moe_flex_dispatcher_backend: str = arg(
        "deepep",
        help="The flex dispatcher's kernels: DeepEP's or HybridEP's (GPU only).",
        choices=["deepep", "hybridep"],
    )
    moe_enable_deepep: bool = arg(
        False,
        help="Deprecated (as in Megatron-LM): --moe-token-dispatcher-type flex with "
        "--moe-flex-dispatcher-backend deepep.",
    )
    moe_grouped_gemm: bool = arg(
        False,
        help="Run a rank's experts as one grouped GEMM (Transformer Engine's or the "
        "grouped_gemm package's kernel, on a GPU).",
    )
    moe_expert_capacity_factor: Optional[float] = arg(
        help="Each expert takes at most this factor times its even share of tokens; the "
        "rest are dropped (default: no limit)."
    )
    moe_pad_expert_input_to_capacity: bool = arg(
        False, help="Pad each expert's input to its capacity (with --moe-expert-capacity-factor)."
    )
    moe_token_drop_policy: str = arg(
        "probs",
        help="Which tokens an expert over capacity drops: lowest probability or last position.",
        choices=["probs", "position"],
    )
    moe_shared_expert_intermediate_size: Optional[int] = arg(
        help="Hidden size of a shared expert every token also goes through (none: no "
        "shared expert)."
    )
    moe_per_layer_logging: bool = arg(
        False, help="Log each MoE layer's auxiliary losses to TensorBoard, not only their mean."
    )
    moe_router_dtype: Optional[str] = arg(
        help="The router's compute precision (default the model's).", choices=["fp32", "fp64"]
    )
    moe_layer_freq: Union[int, List[int]] = arg(
        1,
        help="Which layers are MoE layers: N (every N-th, from the first) or a pattern of "
        "0s (dense) and 1s (MoE) per layer, e.g. '([0]*1+[1]*3)'.",
        parse=layer_pattern,
    )
    moe_router_num_groups: Optional[int] = arg(
        help="Group-limited routing: experts fall into this many equal groups (e.g. one per "
        "expert-parallel rank or node), with --moe-router-group-topk."
    )
    moe_router_group_topk: Optional[int] = arg(
        help="Group-limited routing: each token's experts come from its best this many groups."
    )
    moe_router_enable_expert_bias: bool = arg(
        False,
        help="Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias in the top-k "
        "choice, moved after each iteration toward even loads (with the sigmoid score).",
    )
    moe_router_bias_update_rate: float = arg(
        1e-3, help="How far each iteration moves the expert bias (--moe-router-enable-expert-bias)."
    )
    moe_permute_fusion: bool = arg(
        False, help="Transformer Engine's fused token permutation (a GPU kernel)."
    )
    moe_router_fusion: bool = arg(
        False, help="Transformer Engine's fused router top-k and scores (a GPU kernel)."
    )


@dataclass(kw_only=True)
class BatchConfig:
    """Micro and global batch sizes."""

    micro_batch_size: Optional[int] = arg(help="Samples per microbatch per rank.", required=True)
    global_batch_size: Optional[int] = arg(
        help="Samples per iteration over all ranks (default micro-batch-size * DP)."
    )
    rampup_batch_size: Optional[List[int]] = arg(
        help="Batch-size ramp-up: START INCREMENT SAMPLES, from START to --global-batch-size "
        "in steps of INCREMENT over SAMPLES samples (with --train-samples).",
        nargs=3,
    )


@dataclass(kw_only=True)
class TrainingConfig:
    """Iterations, learning-rate schedule, optimizer and precision."""

    enable_experimental: bool = arg(
        False, help="megatron-core's experimental code paths (its experimental flag)."
    )
    train_iters: Optional[int] = arg(help="Iterations to train (or use --train-samples).")
    train_samples: Optional[int] = arg(help="Samples to train (or use --train-iters).")
    lr: Optional[float] = arg(help="Peak learning rate.", required=True)
    min_lr: float = arg(0.0, help="Learning rate floor.")
    decoupled_lr: Optional[float] = arg(
        help="Peak learning rate of the input embedding and output layer (default --lr)."
    )
    decoupled_min_lr: Optional[float] = arg(
        help="Learning-rate floor of the input embedding and output layer (default --min-lr)."
    )
    lr_decay_style: str = arg(
        "linear",
        help="Learning-rate decay.",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    lr_decay_iters: Optional[int] = arg(help="Decay iterations (default: all).")
    lr_decay_samples: Optional[int] = arg(help="Decay samples (with --train-samples).")
    lr_wsd_decay_style: str = arg(
        "exponential",
        help="Decay of the WSD schedule's last phase.",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
    )
    lr_wsd_decay_iters: Optional[int] = arg(help="Iterations of the WSD decay phase.")
    lr_wsd_decay_samples: Optional[int] = arg(
        help="Samples of the WSD decay phase (with --train-samples)."
    )
    lr_warmup_iters: int = arg(0, help="Warm-up iterations.")
    lr_warmup_fraction: Optional[float] = arg(help="Warm-up as a fraction of decay.")
    lr_warmup_samples: int = arg(0, help="Warm-up samples (with --train-samples).")
    lr_warmup_init: float = arg(0.0, help="Learning rate at the start of warm-up.")
    weight_decay: float = arg(0.01, help="Weight decay.")
    clip_grad: float = arg(1.0, help="Clip gradients to this global norm.")
    optimizer: str = arg("adam", help="Optimizer.", choices=["adam", "sgd"])
    adam_beta1: float = arg(0.9, help="Adam beta1.")
    adam_beta2: float = arg(0.999, help="Adam beta2.")
    adam_eps: float = arg(1e-8, help="Adam epsilon.")
    sgd_momentum: float = arg(0.9, help="SGD momentum.")
    seed: int = arg(1234, help="Random seed.")
    deterministic_mode: bool = arg(
        False,
        help="Deterministic kernels only (torch.use_deterministic_algorithms); on a GPU, "
        "NCCL_ALGO must name a deterministic all-reduce (Tree, Ring, ...).",
    )
    gradient_accumulation_fusion: bool = arg(
        True,
        flag="--no-gradient-accumulation-fusion",
        help="Do not fuse weight-gradient accumulation into the GEMMs (fused on a GPU with "
        "Transformer Engine's layers or Apex's kernel).",
    )
    defer_embedding_wgrad_compute: bool = arg(
        False,
        help="Compute the output embedding's weight gradient at the end of the pipeline "
        "flush, overlapped with other work (needs gradient-accumulation fusion and PP > 1).",
    )
    wgrad_deferral_limit: int = arg(
        0,
        help="With --defer-embedding-wgrad-compute: how many microbatches' gradients to "
        "defer (0: all).",
    )
    bf16: bool = arg(False, help="Train in bfloat16 with fp32 main parameters.")
    fp16: bool = arg(False, help="Train in float16 with loss scaling.")
    loss_scale: Optional[float] = arg(help="Static loss scale (default dynamic).")
    initial_loss_scale: float = arg(2.0**32, help="Initial dynamic loss scale.")
    min_loss_scale: float = arg(1.0, help="Minimum dynamic loss scale.")
    loss_scale_window: float = arg(1000, help="Iterations between loss-scale increases.")
    hysteresis: int = arg(2, help="Overflows tolerated before the scale drops.")
    fp8: Optional[str] = arg(
        flag="--fp8-format",
        help="FP8 compute through Transformer Engine (a GPU with FP8: Hopper or newer).",
        choices=["e4m3", "hybrid"],
    )
    fp8_recipe: str = arg(
        "delayed",
        help="Transformer Engine's FP8 scaling recipe (with --fp8-format).",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise"],
    )
    fp8_amax_history_len: int = arg(1, help="FP8 amax history length (with --fp8-format).")
    fp8_amax_compute_algo: str = arg(
        "most_recent",
        help="FP8 amax from the history (with --fp8-format).",
        choices=["most_recent", "max"],
    )
    fp8_param_gather: bool = arg(
        False, help="Keep parameters in FP8 and all-gather them in FP8 (with --fp8-format)."
    )
    first_last_layers_bf16: bool = arg(
        False,
        help="With --fp8-format, keep the first and last layers of the model in bf16 "
        "(a recipe other than delayed).",
    )
    num_layers_at_start_in_bf16: int = arg(
        1, help="Layers at the start kept in bf16 (with --first-last-layers-bf16)."
    )
    num_layers_at_end_in_bf16: int = arg(
        1, help="Layers at the end kept in bf16 (with --first-last-layers-bf16)."
    )
    accumulate_allreduce_grads_in_fp32: bool = arg(
        False, help="Accumulate and reduce gradients in fp32 (always so with --bf16)."
    )
    grad_reduce_in_bf16: bool = arg(
        False, help="With --bf16, accumulate and reduce gradients in bf16 instead of fp32."
    )
    calculate_per_token_loss: bool = arg(
        False,
        help="Average the loss over all the global batch's tokens instead of over each "
        "microbatch's, then over microbatches and replicas.",
    )
    check_for_nan_in_loss_and_grad: bool = arg(
        True,
        flag="--no-check-for-nan-in-loss-and-grad",
        help="Do not stop on a NaN or Inf in a rank's loss or local gradient norm (checked "
        "before any data-parallel reduction, by megatron-core's validation, as Megatron-LM).",
    )
    rerun_mode: Optional[str] = arg(
        help="What megatron-core's rerun state machine does with a rejected result (a NaN "
        "or Inf loss or gradient, a spiky loss): validate_results (the default) redoes the "
        "iteration in place to tell a reproducible error (exit 17) from a transient one "
        "(checkpoint, exit 16: resume elsewhere); report_stats redoes every iteration and "
        "reports how results vary; disabled stops at once. Under --deadpool, "
        "--deadpool-on-nan takes its place.",
        choices=["disabled", "validate_results", "report_stats"],
    )
    check_for_spiky_loss: bool = arg(
        False,
        help="Treat a loss over 10 times the largest seen so far as suspect (validated as "
        "--rerun-mode says; not fatal).",
    )
    error_injection_rate: int = arg(
        0,
        help="Test the result validation: inject a wrong result once in about this many "
        "validations (0: never).",
    )
    error_injection_type: str = arg(
        "transient_error",
        help="Which wrong result --error-injection-rate injects.",
        choices=["correct_result", "transient_error", "persistent_error"],
    )
    check_weight_hash_across_dp_replicas_interval: Optional[int] = arg(
        help="Every this many iterations (and at the start) compare every parameter's hash "
        "over the data-parallel replicas; a difference stops the run."
    )
    result_rejected_tracker_filename: Optional[str] = arg(
        help="File to which every rejected result is appended (iteration, rank, message)."
    )
    recompute_activations: bool = arg(
        False, help="Recompute each layer's attention core in backward (selective recompute)."
    )
    recompute_granularity: Optional[str] = arg(
        help="Recompute activations in backward instead of keeping them: full (whole layers, "
        "with --recompute-method) or selective (the parts --recompute-modules names).",
        choices=["full", "selective"],
    )
    recompute_method: Optional[str] = arg(
        help="With full recompute: uniform (layers in chunks of --recompute-num-layers, each "
        "chunk's input kept) or block (the first --recompute-num-layers layers of each "
        "pipeline stage).",
        choices=["uniform", "block"],
    )
    recompute_num_layers: Optional[int] = arg(
        help="With full recompute: layers per chunk (uniform) or per stage (block)."
    )
    recompute_modules: Optional[List[str]] = arg(
        help="With selective recompute, the parts recomputed (megatron-core's names: "
        "core_attn, the default, mlp, layernorm, moe, moe_act, shared_experts, mla_up_proj).",
        nargs="+",
    )
    distribute_saved_activations: bool = arg(
        False,
        help="With full recompute and TP > 1, split each recomputed chunk's kept input "
        "over the tensor-parallel group.",
    )
    manual_gc: bool = arg(
        False, help="Python's garbage collector only at set points, the same on every rank."
    )
    manual_gc_interval: int = arg(
        0, help="With --manual-gc, collect every this many iterations (0: never)."
    )
    manual_gc_eval: bool = arg(
        True, flag="--no-manual-gc-eval", help="With --manual-gc, do not collect around validation."
    )
    empty_unused_memory_level: int = arg(
        0,
        help="Free the CUDA allocator's cache: 1 after forward-backward, 2 after the "
        "optimizer step too.",
        choices=[0, 1, 2],
    )


@dataclass(kw_only=True)
class DataConfig:
    """Where samples come from and how text becomes tokens."""

    data_path: Optional[List[str]] = arg(
        help="Dataset prefix, or weight prefix pairs (from tools/preprocess_data.py).", nargs="*"
    )
    mock_data: bool = arg(False, help="Synthetic tokens instead of --data-path.")
    split: str = arg("969,30,1", help="Train,valid,test proportions of --data-path.")
    data_cache_path: Optional[str] = arg(help="Where dataset index caches go.")
    num_workers: int = arg(2, help="Data-loader worker processes.")
    reset_position_ids: bool = arg(False, help="Restart position ids after each EOD.")
    reset_attention_mask: bool = arg(False, help="Mask attention across EOD.")
    eod_mask_loss: bool = arg(False, help="No loss on EOD tokens.")
    create_attention_mask_in_dataloader: bool = arg(
        True,
        flag="--no-create-attention-mask-in-dataloader",
        help="Build no attention mask in the data loader (one is built only for "
        "--reset-attention-mask: the causal mask is implied otherwise).",
    )
    mmap_bin_files: bool = arg(
        True, flag="--no-mmap-bin-files", help="Read the .bin files without memory-mapping them."
    )
    # Fill-in-the-middle (megatron/training/fim.py): samples reordered as
    # prefix, suffix, middle with sentinel tokens, as Megatron-LM's FIM dataset.
    fim_data: bool = arg(False, help="Reorder samples for fill-in-the-middle training.")
    fim_rate: float = arg(0.5, help="Probability that a sample (or segment) is reordered.")
    fim_spm_rate: float = arg(
        0.5,
        help="Probability that a reordered one is suffix-prefix-middle, not prefix-suffix-middle.",
    )
    fim_split_sample: Optional[str] = arg(
        help="A token around which each sample is cut into fragments, reordered one by one."
    )
    fim_fragment_rate: Optional[float] = arg(
        help="Probability that a fragment is reordered (with --fim-split-sample)."
    )
    fim_no_prefix: Optional[str] = arg(
        help="Leave fragments whose text starts with this as they are."
    )
    fim_prefix_token: str = arg("<fim_prefix>", help="The prefix sentinel token.")
    fim_middle_token: str = arg("<fim_middle>", help="The middle sentinel token.")
    fim_suffix_token: str = arg("<fim_suffix>", help="The suffix sentinel token.")
    fim_pad_token: str = arg("<fim_pad>", help="The token a shortened sample is padded with.")
    fim_eod_token: str = arg("<|endoftext|>", help="The end-of-document token segments are cut at.")


# Megatron-LM's --tokenizer-type names (and ours, ByteLevelTokenizer); what
# each needs and which are refused is in tokenizer.py.
TOKENIZER_TYPE_NAMES = [
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "GPT2BPETokenizer",
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "TikTokenizer",
    "MultimodalTokenizer",
    "NullTokenizer",
    "NullMultimodalTokenizer",
    "SFTTokenizer",
    "ByteLevelTokenizer",
]


@dataclass(kw_only=True)
class TokenizerConfig:
    """How text becomes token ids (offline: every file is local)."""

    tokenizer_type: Optional[str] = arg(
        help="Tokenizer (default GPT2BPETokenizer, as Megatron-LM's pretrain_gpt.py).",
        choices=TOKENIZER_TYPE_NAMES,
    )
    tokenizer_model: Optional[str] = arg(
        help="Local tokenizer model: a directory (HuggingFaceTokenizer), a SentencePiece "
        ".model file or a TikTokenizer .json vocabulary."
    )
    vocab_file: Optional[str] = arg(help="GPT-2 BPE vocab.json (GPT2BPETokenizer).")
    merge_file: Optional[str] = arg(help="GPT-2 BPE merges.txt (GPT2BPETokenizer).")
    vocab_size: Optional[int] = arg(
        help="Vocabulary size: NullTokenizer's, the most TikTokenizer ids, or (checked) "
        "HuggingFaceTokenizer's own."
    )
    tokenizer_special_tokens: Optional[List[str]] = arg(
        help="Special tokens to add (HuggingFace, SentencePiece and TikToken tokenizers)."
    )
    tiktoken_pattern: Optional[str] = arg(
        help="TikTokenizer's split pattern: v1 or v2 (default v2)."
    )
    tiktoken_num_special_tokens: int = arg(
        1000, help="Ids TikTokenizer keeps below its vocabulary for special tokens."
    )
    tokenizer_sentencepiece_legacy: bool = arg(
        False, help="SentencePiece's legacy handling of special tokens."
    )
    tokenizer_hf_use_fast: bool = arg(False, help="Use the fast HuggingFace tokenizer class.")
    tokenizer_hf_include_special_tokens: bool = arg(
        False, help="HuggingFace tokenizer: add its special tokens (BOS/EOS) when tokenizing."
    )
    trust_remote_code: bool = arg(
        False, help="Let a local HuggingFace tokenizer directory run its own code."
    )
    legacy_tokenizer: bool = arg(
        False, help="Megatron-LM's own tokenizer classes (refused here: megatron-core's are used)."
    )


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and resuming."""

    save: Optional[str] = arg(help="Directory to save checkpoints in.")
    load: Optional[str] = arg(help="Directory to resume from.")
    save_interval: Optional[int] = arg(help="Iterations between checkpoints.")
    # Megatron-LM's default for these store_true flags is None, not False.
    no_load_optim: Optional[bool] = arg(help="Do not load optimizer state.")
    no_load_rng: Optional[bool] = arg(help="Do not load RNG states.")
    finetune: bool = arg(False, help="Load weights only; start at iteration 0.")
    use_checkpoint_opt_param_scheduler: bool = arg(
        False,
        flag="--use-checkpoint-opt_param-scheduler",
        help="Take the learning-rate and weight-decay schedule from the checkpoint (what "
        "this build does anyway, unless --override-opt_param-scheduler).",
    )
    override_opt_param_scheduler: bool = arg(
        False,
        flag="--override-opt_param-scheduler",
        help="Take the schedule from the command line, not from the checkpoint.",
    )
    exit_on_missing_checkpoint: bool = arg(
        False, help="Exit if --load has no checkpoint instead of starting fresh."
    )
    ckpt_format: str = arg(
        "torch_dist",
        help="Checkpoint format --save writes: torch_dist (megatron-core "
        "dist_checkpointing). --load reads torch_dist and Megatron-LM's legacy torch "
        "format, told from the directory; torch goes with --load only.",
        choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
    )
    non_persistent_save_interval: Optional[int] = arg(
        help="Iterations between non-persistent checkpoints: only the latest is kept "
        "(--non-persistent-ckpt-type global), and --load takes it when it is newer "
        "than the latest --save checkpoint."
    )
    non_persistent_ckpt_type: Optional[str] = arg(
        help="Where non-persistent checkpoints go: global (a torch_dist checkpoint in "
        "--non-persistent-global-ckpt-dir).",
        choices=["global", "local", "in_memory"],
    )
    non_persistent_global_ckpt_dir: Optional[str] = arg(
        help="Directory of global non-persistent checkpoints (default: SAVE/non_persistent)."
    )
    async_save: bool = arg(
        False,
        help="Write the checkpoint's files in the background while training goes on; "
        "the save ends (the tracker names it) at the first iteration's end after "
        "every rank's files are written. torch_dist only; as Megatron-LM, only with "
        "--use-persistent-ckpt-worker (without it the saves are synchronous).",
    )
    pretrained_checkpoint: Optional[str] = arg(
        help="Directory to fine-tune from when --load holds no checkpoint (as --finetune)."
    )
    use_checkpoint_args: bool = arg(
        False,
        help="Take the model's shape (and the flags Megatron-LM takes) from the "
        "checkpoint in --load.",
    )
    use_mp_args_from_checkpoint_args: bool = arg(
        False, help="With --use-checkpoint-args, take TP and PP sizes from the checkpoint too."
    )
    use_tokenizer_model_from_checkpoint_args: bool = arg(
        True,
        flag="--no-use-tokenizer-model-from-checkpoint-args",
        help="With --use-checkpoint-args, do not take the tokenizer type and model "
        "from the checkpoint.",
    )
    # Megatron-LM's default for these store_true flags is None, not False.
    no_save_optim: Optional[bool] = arg(help="Do not save the optimizer and scheduler state.")
    no_save_rng: Optional[bool] = arg(help="Do not save the RNG states.")
    ckpt_fully_parallel_save: bool = arg(
        True,
        flag="--no-ckpt-fully-parallel-save",
        help="Write each shard from one rank only, without spreading the writes "
        "over the data-parallel group.",
    )
    ckpt_fully_parallel_save_deprecated: bool = arg(
        False,
        flag="--ckpt-fully-parallel-save",
        help="Deprecated in Megatron-LM, no effect: fully parallel saves are the default "
        "(--no-ckpt-fully-parallel-save turns them off).",
    )
    ckpt_fully_parallel_load: bool = arg(
        False, help="Read each shard once and exchange it over the data-parallel group."
    )
    ckpt_assume_constant_structure: bool = arg(
        False,
        help="The state's structure stays the same between saves: plan a save once and "
        "reuse the plan (planned again after a recovery changed the layout).",
    )
    save_retain_interval: Optional[int] = arg(
        help="Keep only the saves of iterations that are multiples of this (a multiple "
        "of --save-interval), and the latest."
    )
    use_persistent_ckpt_worker: bool = arg(
        False,
        help="The background writer of --async-save (which Megatron-LM, and this build, "
        "run only with it). Here the writer is a thread of the rank.",
    )
    auto_detect_ckpt_format: bool = arg(
        False,
        help="Tell the format of --load's checkpoint from its files: always done here.",
    )
    dist_ckpt_optim_fully_reshardable: bool = arg(
        False,
        help="Save the distributed optimizer so that it loads at another TP and PP "
        "too (default: data-parallel resharding only).",
    )
    dist_ckpt_strictness: str = arg(
        "assume_ok_unexpected",
        help="What a load does with keys missing from or unexpected in the checkpoint.",
        choices=[
            "assume_ok_unexpected",
            "log_unexpected",
            "log_all",
            "raise_unexpected",
            "raise_all",
            "return_unexpected",
            "return_all",
            "ignore_all",
        ],
    )


@dataclass(kw_only=True)
class LoggingConfig:
    """Log line, validation and exits."""

    log_interval: int = arg(100, help="Iterations between log lines.")
    logging_level: Optional[int] = arg(
        help="Level of Python's root logger (10 DEBUG ... 50 CRITICAL; default the "
        "MEGATRON_LOGGING_LEVEL variable, else INFO)."
    )
    log_throughput: bool = arg(False, help="Add TFLOP/s per GPU to the log line.")
    log_params_norm: bool = arg(
        False, help="Add the parameters' L2 norm to the log line (computed every iteration)."
    )
    log_num_zeros_in_grad: bool = arg(
        False, help="Add the number of zeros in the gradients to the log line."
    )
    eval_interval: int = arg(1000, help="Iterations between validations.")
    eval_iters: int = arg(100, help="Iterations per validation (0 disables it).")
    exit_signal_handler: bool = arg(
        False, help="On SIGTERM save a checkpoint (with --save) and exit cleanly."
    )
    exit_duration_in_mins: Optional[float] = arg(help="Save and exit after this many minutes.")
    # No '%' in help texts: argparse formats them.
    exit_interval: Optional[int] = arg(
        help="Exit the program after the iteration is divisible by this value (saving first)."
    )
    metrics_file: Optional[str] = arg(
        help="Write each iteration's exact loss and grad norm as JSONL (last rank)."
    )
    tensorboard_dir: Optional[str] = arg(
        help="Write TensorBoard scalars here (from the last rank, Megatron-LM's names)."
    )
    tensorboard_log_interval: int = arg(1, help="Iterations between TensorBoard scalars.")
    tensorboard_queue_size: int = arg(
        1000, help="TensorBoard events held in memory before they are written."
    )
    log_timers_to_tensorboard: bool = arg(
        False,
        help="Iteration time (and throughput with --log-throughput), and the timers of "
        "--timing-log-level, to TensorBoard.",
    )
    timing_log_level: int = arg(
        0,
        help="Timers in the log: 0 none, 1 the step's parts (forward-backward, gradient "
        "reduce, optimizer), 2 also each microbatch's compute and pipeline sends.",
        choices=[0, 1, 2],
    )
    timing_log_option: str = arg(
        "minmax",
        help="Timers over ranks: the max, the (min, max), or all ranks.",
        choices=["max", "minmax", "all"],
    )
    log_loss_scale_to_tensorboard: bool = arg(
        True,
        flag="--no-log-loss-scale-to-tensorboard",
        help="Do not write the loss scale to TensorBoard.",
    )
    log_validation_ppl_to_tensorboard: bool = arg(
        False, help="Validation perplexity to TensorBoard too."
    )
    log_memory_to_tensorboard: bool = arg(
        False, help="CUDA allocator memory to TensorBoard (GPU only)."
    )
    log_world_size_to_tensorboard: bool = arg(False, help="World size to TensorBoard.")
    profile: bool = arg(
        False, help="Profile iterations --profile-step-start to --profile-step-end."
    )
    profile_step_start: int = arg(10, help="First profiled iteration (with --profile).")
    profile_step_end: int = arg(12, help="Iteration after the last profiled one (with --profile).")
    use_pytorch_profiler: bool = arg(
        False,
        help="Profile with torch.profiler, traces to --tensorboard-dir (default: a CUDA "
        "profiler range for nsys, on a GPU).",
    )
    profile_ranks: List[int] = arg([0], help="Global ranks that profile.", nargs="+")
    wandb_project: Optional[str] = arg(
        help="Weights & Biases project (offline unless W&B credentials or WANDB_MODE are set)."
    )
    wandb_exp_name: Optional[str] = arg(help="Weights & Biases run name.")
    wandb_save_dir: Optional[str] = arg(help="Weights & Biases run directory (default SAVE/wandb).")
    wandb_entity: Optional[str] = arg(help="Weights & Biases entity (team).")


@dataclass(kw_only=True)
class GpuConfig:
    """Megatron-LM's GPU-only features: communication overlaps, activation
    offloading and CUDA graphs (megatron-core's and Transformer Engine's, with
    their flags, defaults and rules; refused on a CPU, and under --deadpool
    until a recovery with them is shown)."""

    tp_comm_overlap: bool = arg(
        False,
        help="Overlap tensor-parallel communication with the GEMMs (Transformer Engine's "
        "userbuffers; with --sequence-parallel).",
    )
    tp_comm_overlap_cfg: Optional[str] = arg(
        help="A YAML file of Transformer Engine's userbuffer settings per GEMM (default: its own)."
    )
    tp_comm_bootstrap_backend: str = arg(
        "nccl",
        help="The backend that sets up the userbuffers' communicators.",
        choices=["nccl", "mpi", "gloo"],
    )
    tp_comm_overlap_ag: bool = arg(
        True,
        flag="--disable-tp-comm-overlap-ag",
        aliases=("--no-tp-comm-overlap-ag",),
        help="Do not overlap the all-gathers with the GEMMs (--tp-comm-overlap).",
    )
    tp_comm_overlap_rs: bool = arg(
        True,
        flag="--disable-tp-comm-overlap-rs",
        aliases=("--no-tp-comm-overlap-rs",),
        help="Do not overlap the reduce-scatters with the GEMMs (--tp-comm-overlap).",
    )
    tp_comm_overlap_rs_dgrad: bool = arg(
        False, help="Overlap the reduce-scatter with the data-gradient GEMM (--tp-comm-overlap)."
    )
    tp_comm_bulk_dgrad: bool = arg(
        True,
        flag="--disable-tp-comm-bulk-dgrad",
        aliases=("--no-tp-comm-bulk-dgrad",),
        help="Do not overlap the bulk all-gather with the data-gradient GEMM (--tp-comm-overlap).",
    )
    tp_comm_bulk_wgrad: bool = arg(
        True,
        flag="--disable-tp-comm-bulk-wgrad",
        aliases=("--no-tp-comm-bulk-wgrad",),
        help="Do not overlap the bulk reduce-scatter with the weight-gradient GEMM "
        "(--tp-comm-overlap).",
    )
    tp_comm_split_ag: bool = arg(
        True,
        flag="--disable-tp-comm-split-ag",
        aliases=("--no-tp-comm-split-ag",),
        help="Do not split the all-gathers' GEMMs into chunks to overlap (--tp-comm-overlap).",
    )
    tp_comm_split_rs: bool = arg(
        True,
        flag="--disable-tp-comm-split-rs",
        aliases=("--no-tp-comm-split-rs",),
        help="Do not split the reduce-scatters' GEMMs into chunks to overlap (--tp-comm-overlap).",
    )
    overlap_moe_expert_parallel_comm: bool = arg(
        False,
        help="Overlap the MoE layers' expert-parallel all-to-all with another microbatch's "
        "compute (megatron-core's combined 1F1B schedule).",
    )
    delay_wgrad_compute: bool = arg(
        False,
        help="Delay the experts' weight-gradient GEMMs to overlap more communication "
        "(with --overlap-moe-expert-parallel-comm).",
    )
    ep_overlap_early_attn_memory_release: bool = arg(
        False,
        help="Free the attention's activations early in the combined 1F1B schedule "
        "(with --overlap-moe-expert-parallel-comm).",
    )
    fine_grained_activation_offloading: bool = arg(
        False,
        help="Keep the activations of --offload-modules in host memory between forward "
        "and backward.",
    )
    offload_modules: List[str] = arg(
        [],
        help="What --fine-grained-activation-offloading offloads: attn_norm, qkv_linear, "
        "core_attn, attn_proj, mlp_norm, expert_fc1, moe_act.",
    )
    min_offloaded_tensor_size: int = arg(
        1024 * 1024, help="Smaller activations stay on the GPU (elements)."
    )
    cuda_graph_impl: str = arg(
        "none",
        help="CUDA graphs: transformer_engine captures the layers' forward and backward "
        "after --cuda-graph-warmup-steps iterations (local, megatron-core's own, is not "
        "here).",
        choices=["none", "local", "transformer_engine"],
    )
    cuda_graph_scope: List[str] = arg(
        [],
        help="What the graphs capture: attn, mlp, moe, moe_router, moe_preprocess "
        "(default: whole layers).",
    )
    cuda_graph_warmup_steps: int = arg(
        3, help="Iterations run before the CUDA graphs are captured."
    )
    external_cuda_graph: bool = arg(
        False, help="Deprecated in Megatron-LM: the same as --cuda-graph-impl transformer_engine."
    )
    te_rng_tracker: bool = arg(
        False,
        help="Transformer Engine's random-state tracker (on with CUDA graphs, which need it).",
    )


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "moe": MoEConfig,
    "batch": BatchConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "tokenizer": TokenizerConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "gpu": GpuConfig,
}


@dataclass
class RunContext:
    """What a run learns beside its flags: where it computes and its
    vocabulary (set as its trainer is built), and what a script written
    against Megatron-LM's API brings (megatron_lm.py): its datasets provider
    and the values of its own flags."""

    on_cpu: bool = False
    tokenizer: Optional[Any] = None
    padded_vocab_size: Optional[int] = None
    # (config, samples per split, tokenizer) -> (train, valid, test) datasets
    datasets_provider: Optional[Callable] = None
    script_args: Dict[str, Any] = field(default_factory=dict)


@dataclass
class WorldLayout:
    """The world of a job an extension resized (deadpool's shrink or grow):
    the node of every rank, and the world size the job was launched with.
    Empty until the first resize."""

    rank_nodes: Optional[List[str]] = None
    planned_world_size: Optional[int] = None


Section = TypeVar("Section")


@dataclass
class Config:
    """All sections of a run, plus the world it runs in."""

    model: ModelConfig
    parallel: ParallelConfig
    moe: MoEConfig
    batch: BatchConfig
    training: TrainingConfig
    data: DataConfig
    tokenizer: TokenizerConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    gpu: GpuConfig = field(default_factory=GpuConfig)
    world_size: int = 1
    run: RunContext = field(default_factory=RunContext)
    world: WorldLayout = field(default_factory=WorldLayout)
    # The sections extensions add (their dataclass of flags), by their type.
    extensions: Dict[type, Any] = field(default_factory=dict)

    def section(self, cls: Type[Section]) -> Section:
        """The extension section of type ``cls``: as parsed, or its defaults
        where the flags were parsed without it."""
        found = self.extensions.get(cls)
        return cls() if found is None else found

    @property
    def planned_world_size(self) -> int:
        """The world size the job was launched with (a resize changes world_size)."""
        return self.world.planned_world_size or self.world_size

    @property
    def data_parallel_size(self) -> int:
        p = self.parallel
        model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
        return self.world_size // (model_parallel * p.context_parallel_size)

    @property
    def split_layers(self) -> int:
        """The layers split between pipeline stages: the transformer layers,
        plus one for the embedding and one for the loss where the
        --account-for-*-in-pipeline-split flags count them."""
        p = self.parallel
        extra = int(p.account_for_embedding_in_pipeline_split)
        return self.model.num_layers + extra + int(p.account_for_loss_in_pipeline_split)

    @property
    def virtual_pipeline_model_parallel_size(self) -> Optional[int]:
        """Model chunks per pipeline rank (the interleaved schedule), None
        for one: Megatron-LM's derivation from either flag."""
        p = self.parallel
        if p.pipeline_model_parallel_layout is not None:
            try:
                stages = len(layout_stages(p.pipeline_model_parallel_layout))
            except AssertionError:
                return None  # refused by the parse's check of the layout
            size = stages // p.pipeline_model_parallel_size
        elif p.num_virtual_stages_per_pipeline_rank is not None:
            size = p.num_virtual_stages_per_pipeline_rank
        elif p.num_layers_per_virtual_pipeline_stage is not None:
            per_rank = self.split_layers // p.pipeline_model_parallel_size
            size = per_rank // p.num_layers_per_virtual_pipeline_stage
        else:
            return None
        return None if size == 1 else size

    @property
    def model_chunks(self) -> int:
        """Model chunks on each pipeline rank (1 without virtual stages)."""
        return self.virtual_pipeline_model_parallel_size or 1
