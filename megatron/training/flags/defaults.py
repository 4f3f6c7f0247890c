"""Megatron's derived defaults: what a parsed config leaves unset, filled
from its other flags, as Megatron-LM fills them (and says so where it
turns a flag off)."""

from megatron.training.config import Config
from megatron.training.flags import batch, host
from megatron.training.flags.refusal import require, say, warn
from megatron.training.schedule import GlobalBatch


def fill_defaults(config: Config) -> None:
    """Megatron's derived defaults, computed from the other flags."""
    m, b, t = config.model, config.batch, config.training
    if m.ffn_hidden_size is None and m.hidden_size:
        m.ffn_hidden_size = int(8 * m.hidden_size / 3 / 64) * 64 if m.swiglu else 4 * m.hidden_size
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if not m.group_query_attention:
        m.num_query_groups = m.num_attention_heads
    if m.use_rotary_position_embeddings:  # Megatron-LM's older spelling
        m.position_embedding_type = "rope"
    if b.global_batch_size is None and b.micro_batch_size and config.data_parallel_size > 0:
        b.global_batch_size = b.micro_batch_size * config.data_parallel_size
    require(
        (t.train_iters is None) != (t.train_samples is None),
        "give exactly one of --train-iters and --train-samples",
    )
    if t.train_samples is not None and b.global_batch_size and batch.ramp_is_sound(config):
        # As Megatron-LM: whole global batches (a partial last one is dropped).
        t.train_iters = GlobalBatch(config).iterations(t.train_samples)
    elif t.lr_decay_iters is None:
        t.lr_decay_iters = t.train_iters
    if config.tokenizer.tokenizer_type is None:
        from megatron.training.tokenizer import DEFAULT_TOKENIZER_TYPE

        config.tokenizer.tokenizer_type = DEFAULT_TOKENIZER_TYPE  # as Megatron-LM's pretrain_gpt.py
    fill_moe_defaults(config)
    fill_cuda_graph_defaults(config)
    if t.recompute_activations:
        t.recompute_granularity = "selective"  # as Megatron-LM
    if t.fp16 and t.loss_scale is None and t.check_for_nan_in_loss_and_grad:
        # As Megatron-LM: an overflow is the dynamic loss scaler's signal, not an error.
        say(
            "WARNING: setting --check-for-nan-in-loss-and-grad off: dynamic loss scaling "
            "(--fp16 without --loss-scale) reads NaNs in the gradients as overflows"
        )
        t.check_for_nan_in_loss_and_grad = False
    p = config.parallel
    if config.virtual_pipeline_model_parallel_size is None:
        p.overlap_p2p_comm = False  # as Megatron-LM: only the interleaved schedule overlaps
    if p.sequence_parallel and p.tensor_model_parallel_size == 1:
        # As Megatron-LM: a warning, and sequence parallelism off.
        say("WARNING: disabling --sequence-parallel: --tensor-model-parallel-size is 1")
        p.sequence_parallel = False
    if not host.cuda_available() or config.parallel.cpu:
        config.parallel.distributed_backend = "gloo"


def fill_moe_defaults(config: Config) -> None:
    """As Megatron-LM: --num-experts 0 is a dense model; experts as wide as
    the dense MLP; expert TP as the model's TP; a single load-balancing type
    or coefficient given as itself, not as a list of one."""
    moe, p = config.moe, config.parallel
    if moe.num_experts == 0:
        moe.num_experts = None
    if moe.num_experts is not None and moe.moe_ffn_hidden_size is None:
        moe.moe_ffn_hidden_size = config.model.ffn_hidden_size
    if p.expert_tensor_parallel_size is None:
        p.expert_tensor_parallel_size = p.tensor_model_parallel_size
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(moe, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(moe, name, value[0])


def fill_cuda_graph_defaults(config: Config) -> None:
    """As Megatron-LM: --external-cuda-graph is the deprecated spelling of
    --cuda-graph-impl transformer_engine, and CUDA graphs turn on Transformer
    Engine's random-state tracker."""
    g = config.gpu
    if g.external_cuda_graph:
        require(
            g.cuda_graph_impl == "none",
            "--external-cuda-graph is deprecated: give --cuda-graph-impl transformer_engine alone",
        )
        warn("--external-cuda-graph is deprecated: use --cuda-graph-impl transformer_engine")
        g.cuda_graph_impl = "transformer_engine"
    if g.cuda_graph_impl != "none" and not g.te_rng_tracker:
        warn("turning --te-rng-tracker on: CUDA graphs need it (as Megatron-LM)")
        g.te_rng_tracker = True
