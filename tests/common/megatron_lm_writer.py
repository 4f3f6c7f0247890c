"""Checkpoints written as Megatron-LM writes them (tag core_v0.16.1,
megatron/training/checkpointing.py), by a GPT trained here without this
repository's trainer: megatron-core's GPTModel with the local layer spec,
its DistributedDataParallel, get_megatron_optimizer and
OptimizerParamScheduler, built from Megatron-LM's flags the way Megatron-LM's
pretrain_gpt.py, get_model and setup_model_and_optimizer build them.

Run under torchrun, with Megatron-LM's flags::

    torchrun --nproc-per-node 4 megatron_lm_writer.py --out DIR -- \\
        --num-layers 4 ... --use-distributed-optimizer --train-iters 2

It trains --train-iters iterations on random tokens and writes that one state
three times:

- ``DIR/torch_dist``: ``--ckpt-format torch_dist`` (Megatron-LM's default):
  ``iter_N/`` through megatron-core's dist_checkpointing, with Megatron-LM's
  common state, sharded RNG states and content metadata;
- ``DIR/torch``: ``--ckpt-format torch``: ``iter_N/mp_rank_TT[_PPP]/
  model_optim_rng.pt`` from each data-parallel rank 0, and with the
  distributed optimizer ``distrib_optim.pt`` beside it, written by
  megatron-core's DistributedOptimizer.save_parameter_state;
- ``DIR/reference``: torch_dist again, with --dist-ckpt-optim-fully-reshardable
  (each parameter's optimizer state under its own key, no bucket padding), to
  compare a run's saved state with.

Each with Megatron-LM's tracker file. Only what needs CUDA differs from a GPU
run: megatron.training.cpu_compat maps CUDA calls to the CPU, and the fused
kernels (bias-GeLU, bias-dropout, softmax, persistent layer norm, gradient
accumulation) are off, which changes no key, shape or file.
"""

import argparse
import dataclasses
import os
import queue
import random
import signal
import sys
from functools import partial
from typing import Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

CHECKPOINT_VERSION = 3.0
TRACKER = "latest_checkpointed_iteration.txt"


def megatron_lm_defaults() -> Dict[str, object]:
    """A part of the Namespace Megatron-LM's parse_args and validate_args
    give at core_v0.16.1 (about 650 keys there): every key that its load path
    or ours reads, those that build the model, DDP, optimizer and scheduler,
    and others of every kind of value the Namespace holds (torch dtypes,
    enums, signals, lists, None)."""
    from megatron.core.transformer.enums import AttnBackend

    return dict(
        # model
        num_layers=None,
        encoder_num_layers=None,
        hidden_size=None,
        ffn_hidden_size=None,
        num_attention_heads=None,
        kv_channels=None,
        group_query_attention=False,
        num_query_groups=1,
        seq_length=None,
        encoder_seq_length=None,
        max_position_embeddings=None,
        position_embedding_type="learned_absolute",
        add_position_embedding=True,
        use_rotary_position_embeddings=False,
        rotary_base=10000,
        rotary_percent=1.0,
        rotary_interleaved=False,
        use_rope_scaling=False,
        make_vocab_size_divisible_by=128,
        normalization="LayerNorm",
        layernorm_epsilon=1e-5,  # --norm-epsilon
        hidden_dropout=0.1,
        attention_dropout=0.1,
        init_method_std=0.02,
        swiglu=False,
        squared_relu=False,
        quick_geglu=False,
        add_bias_linear=True,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=False,
        apply_query_key_layer_scaling=False,
        attention_softmax_in_fp32=False,
        apply_residual_connection_post_layernorm=False,
        fp32_residual_connection=False,
        qk_layernorm=False,
        multi_latent_attention=False,
        num_experts=None,
        transformer_impl="transformer_engine",
        use_legacy_models=False,
        spec=None,
        bias_gelu_fusion=True,
        bias_swiglu_fusion=True,
        bias_dropout_fusion=True,
        masked_softmax_fusion=True,
        gradient_accumulation_fusion=True,
        no_persist_layer_norm=False,
        apply_rope_fusion=False,
        attention_backend=AttnBackend.auto,
        recompute_granularity=None,
        fp16=False,
        bf16=False,
        fp8=None,
        fp16_lm_cross_entropy=False,
        cross_entropy_loss_fusion=False,
        calculate_per_token_loss=False,
        # parallelism
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        transformer_pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        sequence_parallel=False,
        context_parallel_size=1,
        cp_comm_type=["p2p"],
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=1,
        use_distributed_optimizer=False,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        accumulate_allreduce_grads_in_fp32=False,
        check_for_nan_in_loss_and_grad=True,
        check_for_large_grads=False,
        ddp_bucket_size=None,
        ddp_num_buckets=None,
        ddp_pad_buckets_for_high_nccl_busbw=False,
        ddp_reduce_scatter_with_fp32_accumulation=False,
        ddp_average_in_collective=False,
        num_distributed_optimizer_instances=1,
        distributed_backend="nccl",
        distributed_timeout_minutes=10,
        enable_gloo_process_groups=True,
        use_tp_pp_dp_mapping=False,
        data_parallel_random_init=False,
        # optimizer and schedule
        optimizer="adam",
        lr=None,
        min_lr=0.0,
        lr_decay_style="linear",
        lr_decay_iters=None,
        lr_warmup_iters=0,
        lr_warmup_fraction=None,
        lr_warmup_init=0.0,
        lr_wsd_decay_style="exponential",
        lr_wsd_decay_iters=None,
        weight_decay=0.01,
        start_weight_decay=None,
        end_weight_decay=None,
        weight_decay_incr_style="constant",
        clip_grad=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        sgd_momentum=0.9,
        loss_scale=None,
        initial_loss_scale=4294967296,
        min_loss_scale=1.0,
        loss_scale_window=1000,
        hysteresis=2,
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=False,
        decoupled_lr=None,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        main_grads_dtype=torch.float32,
        main_params_dtype=torch.float32,
        use_precision_aware_optimizer=False,
        # batch and training
        micro_batch_size=None,
        global_batch_size=None,
        rampup_batch_size=None,
        train_iters=None,
        train_samples=None,
        seed=1234,
        eval_iters=100,
        eval_interval=None,
        log_interval=100,
        exit_interval=None,
        exit_duration_in_mins=None,
        exit_signal_handler=False,
        exit_signal=signal.SIGTERM,
        rerun_mode="validate_results",
        iterations_to_skip=[],
        # data
        data_path=None,
        mock_data=False,
        split=None,
        tokenizer_type=None,
        vocab_size=None,
        vocab_file=None,
        merge_file=None,
        tokenizer_model=None,
        num_workers=2,
        data_cache_path=None,
        create_attention_mask_in_dataloader=True,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # checkpoints
        save=None,
        load=None,
        save_interval=None,
        ckpt_format="torch_dist",
        auto_detect_ckpt_format=False,
        ckpt_fully_parallel_save=True,
        ckpt_fully_parallel_load=False,
        ckpt_assume_constant_structure=False,
        dist_ckpt_strictness="assume_ok_unexpected",
        dist_ckpt_optim_fully_reshardable=False,
        distrib_optim_fully_reshardable_mem_efficient=False,
        no_save_optim=None,
        no_save_rng=None,
        no_load_optim=None,
        no_load_rng=None,
        finetune=False,
        exit_on_missing_checkpoint=False,
        async_save=False,
        non_persistent_ckpt_type=None,
        pretrained_checkpoint=None,
        use_checkpoint_args=False,
        use_mp_args_from_checkpoint_args=False,
        use_tokenizer_model_from_checkpoint_args=True,
        ckpt_step=None,
        ckpt_convert_update_legacy_dist_opt_format=False,
        # logging
        tensorboard_dir=None,
        wandb_project=None,
        log_throughput=False,
        timing_log_level=0,
        enable_one_logger=True,
        one_logger_project="megatron-lm",
        profile=False,
        profile_ranks=[0],
        cuda_graph_impl="none",
    )


# ----- flags -----
def parse_flags(argv: List[str]) -> argparse.Namespace:
    """Megatron-LM's flags by their names (``--no-persist-layer-norm`` sets
    ``no_persist_layer_norm``); a value is read as an int, a float or a string,
    a flag without one is a store_true."""
    values = megatron_lm_defaults()
    i = 0
    while i < len(argv):
        name = argv[i][2:].replace("-", "_")
        if not argv[i].startswith("--") or name not in values:
            raise SystemExit(f"megatron_lm_writer: unknown flag {argv[i]}")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values[name] = _value(argv[i + 1])
            i += 2
        else:
            values[name] = True
            i += 1
    return derive(argparse.Namespace(**values))


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def derive(args: argparse.Namespace) -> argparse.Namespace:
    """What Megatron-LM's validate_args (and the setup after it) derive."""
    args.world_size = int(os.environ["WORLD_SIZE"])
    args.rank = int(os.environ["RANK"])
    args.local_rank = int(os.environ["LOCAL_RANK"])
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    args.data_parallel_size = args.world_size // (model_parallel * args.context_parallel_size)
    args.transformer_pipeline_model_parallel_size = args.pipeline_model_parallel_size
    args.encoder_num_layers, args.encoder_seq_length = args.num_layers, args.seq_length
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.ffn_hidden_size is None:
        h = args.hidden_size
        args.ffn_hidden_size = int(8 * h / 3 / 64) * 64 if args.swiglu else 4 * h
    if args.kv_channels is None:
        args.kv_channels = args.hidden_size // args.num_attention_heads
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.half if args.fp16 else torch.float32
    if args.fp16 and not args.loss_scale:
        args.check_for_nan_in_loss_and_grad = False  # NaNs are the loss scaler's signal
    if args.bf16:
        args.accumulate_allreduce_grads_in_fp32 = True
    if args.start_weight_decay is None:
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.tokenizer_type != "NullTokenizer":
        raise SystemExit("megatron_lm_writer: only --tokenizer-type NullTokenizer (no files)")
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    args.padded_vocab_size = -(-(args.vocab_size + 1) // multiple) * multiple  # eod is V
    args.use_dist_ckpt = args.ckpt_format != "torch"
    return args


# ----- setup, as Megatron-LM's initialize_megatron and setup_model_and_optimizer -----
def initialize(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    from megatron.training import cpu_compat

    cpu_compat.enable(force=True)
    # The writers' results stay in this process (a spawned Manager would
    # import torch again on every rank); no byte written changes.
    filesystem_async._results_queue = queue.Queue()
    dist.init_process_group("gloo", world_size=args.world_size, rank=args.rank)
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order="tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        create_gloo_process_groups=args.enable_gloo_process_groups,
    )
    init_num_microbatches_calculator(
        args.rank,
        args.rampup_batch_size,
        args.global_batch_size,
        args.micro_batch_size,
        args.data_parallel_size,
    )
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(args: argparse.Namespace):
    """Megatron-LM's core_transformer_config_from_args, for a dense GPT."""
    from megatron.core.transformer import TransformerConfig

    kwargs = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TransformerConfig)
        if hasattr(args, f.name)
    }
    kwargs.update(
        persist_layer_norm=not args.no_persist_layer_norm,
        deallocate_pipeline_outputs=True,
        pipeline_dtype=args.params_dtype,
        num_moe_experts=args.num_experts,
        bias_activation_fusion=args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        cp_comm_type=args.cp_comm_type[0],
        inference_sampling_seed=args.seed,
    )
    if args.swiglu:
        kwargs.update(activation_func=F.silu, gated_linear_unit=True)
    # CUDA kernels: none on a CPU.
    kwargs.update(
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )
    return TransformerConfig(**kwargs)


def build(args: argparse.Namespace):
    """Model (get_model), optimizer and scheduler, as Megatron-LM builds them."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import AdamOptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if args.transformer_impl != "local":
        raise SystemExit("megatron_lm_writer: give --transformer-impl local (no TE on a CPU)")
    config = transformer_config(args)
    module = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(
            args.num_experts,
            False,
            args.qk_layernorm,
            args.multi_latent_attention,
            normalization=args.normalization,
        ),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
    )
    for param in module.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if args.fp16 or args.bf16:
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(config, module)
    ddp_kwargs = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(DistributedDataParallelConfig)
        if hasattr(args, f.name)
    }
    ddp_kwargs.update(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        check_for_large_grads=args.check_for_large_grads,
        bucket_size=args.ddp_bucket_size,
        pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
        reduce_scatter_with_fp32_accumulation=args.ddp_reduce_scatter_with_fp32_accumulation,
        average_in_collective=args.ddp_average_in_collective,
    )
    ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
    if ddp_config.bucket_size is None:
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        ddp_config.bucket_size = max(40000000, 1000000 * dp)
    if not ddp_config.overlap_grad_reduce:
        ddp_config.bucket_size = None
    model = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)]
    opt_kwargs = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(AdamOptimizerConfig)
        if hasattr(args, f.name)
    }
    optimizer = get_megatron_optimizer(
        AdamOptimizerConfig(**opt_kwargs),
        model,
        use_gloo_process_groups=args.enable_gloo_process_groups,
    )
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.lr_decay_iters * gbs,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=args.train_iters * gbs,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    return model, optimizer, scheduler


# ----- training on random tokens -----
def microbatches(args: argparse.Namespace, iteration: int, count: int):
    """Random tokens, the same on the first and last stage of a replica."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank()
    b, s = args.micro_batch_size, args.seq_length
    for index in range(count):
        seed = args.seed + 10000 * iteration + 100 * dp_rank + index
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, args.vocab_size, (b, s + 1), generator=generator)
        yield {
            "tokens": tokens[:, :-1],
            "labels": tokens[:, 1:],
            "loss_mask": torch.ones(b, s),
            "position_ids": torch.arange(s).expand(b, s),
            "attention_mask": torch.tril(torch.ones(1, 1, s, s)) < 0.5,
        }


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's: the token sum and count; the schedule averages."""
    loss = torch.sum(output_tensor.view(-1).float() * loss_mask.view(-1))
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    return output, partial(loss_func, batch["loss_mask"])


def train(args: argparse.Namespace, model, optimizer, scheduler) -> None:
    """Megatron-LM's train_step, --train-iters times; advances its counters."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    count = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    forward_backward = get_forward_backward_func()
    for iteration in range(args.train_iters):
        args.curr_iteration = iteration
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=microbatches(args, iteration, count),
            model=model,
            num_microbatches=count,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        update_successful, _, _ = optimizer.step()
        if update_successful:
            scheduler.step(increment=args.global_batch_size)
        args.consumed_train_samples += args.global_batch_size


def flops_per_iteration(args: argparse.Namespace) -> float:
    """A dense GPT's, counted as Megatron-LM counts them: 3 GEMM passes, 2
    FLOPs per multiply-add, causal attention halved, the logits included."""
    h, s, layers = args.hidden_size, args.seq_length, args.num_layers
    attention = 4 * h * h + h * s  # QKV and output projections; QK^T and (QK^T)V over s/2
    mlp = 2 * h * args.ffn_hidden_size
    logits = h * args.padded_vocab_size
    return 3 * 2 * args.global_batch_size * s * (layers * (attention + mlp) + logits)


# ----- the two formats, as Megatron-LM's save_checkpoint writes them -----
def checkpoint_args(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def sharding_metadata(args: argparse.Namespace) -> dict:
    from megatron.core import parallel_state

    metadata = {}
    if args.use_distributed_optimizer:
        if args.dist_ckpt_optim_fully_reshardable:
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = (
                args.distrib_optim_fully_reshardable_mem_efficient
            )
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    metadata["singleton_local_shards"] = False
    metadata["chained_optim_avoid_prefix"] = True
    metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata


def common_state(args, model, optimizer, scheduler, rng, iteration, flops, sharded, metadata):
    """Megatron-LM's generate_state_dict, plus the FLOPs so far."""
    state = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    module = model[0].module
    while hasattr(module, "module"):  # Float16Module
        module = module.module
    if sharded:
        state["model"] = module.sharded_state_dict(metadata=metadata)
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    else:
        state["model"] = module.state_dict_for_save_checkpoint()
        state["optimizer"] = optimizer.state_dict()
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = rng
    state["num_floating_point_operations_so_far"] = flops
    return state


def save_torch_dist(root: str, args, model, optimizer, scheduler, flops: float, **changes) -> None:
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

    args = checkpoint_args(args, ckpt_format="torch_dist", use_dist_ckpt=True, save=root, **changes)
    iteration = args.train_iters
    rng = ShardedObject(
        "rng_state",
        [rng_state()],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True),
    )
    metadata = sharding_metadata(args)
    state = common_state(args, model, optimizer, scheduler, rng, iteration, flops, True, metadata)
    directory = os.path.join(root, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    strategy = get_default_save_sharded_strategy("torch_dist")
    if args.ckpt_fully_parallel_save:
        group = ps.get_data_parallel_group(with_context_parallel=True)
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, group, args.ckpt_assume_constant_structure
        )
    dist_checkpointing.save(
        state,
        directory,
        strategy,
        preprocess_common_before_consistancy_check=without_rank,
        content_metadata=_clean_metadata_for_serialization(metadata),
    )
    finish(root, iteration)


def without_rank(common: dict) -> dict:
    """Megatron-LM's preprocess_common_state_dict: ranks may differ in their
    own rank only."""
    args = {k: v for k, v in vars(common["args"]).items() if k not in ("rank", "local_rank")}
    return {**common, "args": args}


def save_torch(root: str, args, model, optimizer, scheduler, flops: float) -> None:
    from megatron.core import parallel_state as ps

    args = checkpoint_args(args, ckpt_format="torch", use_dist_ckpt=False, save=root)
    iteration = args.train_iters
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    directory = os.path.join(root, f"iter_{iteration:07d}", name)
    os.makedirs(directory, exist_ok=True)
    if args.use_distributed_optimizer:
        optimizer.save_parameter_state(os.path.join(directory, "distrib_optim.pt"))
    if ps.get_expert_data_parallel_rank() == 0:
        state = common_state(
            args, model, optimizer, scheduler, [rng_state()], iteration, flops, False, None
        )
        torch.save(state, os.path.join(directory, "model_optim_rng.pt"))
    finish(root, iteration)


def finish(root: str, iteration: int) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(root, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()


# ----- entry point -----
def split_argv(argv: List[str]) -> Tuple[str, List[str]]:
    """``--out DIR -- <Megatron-LM flags>``."""
    if len(argv) < 3 or argv[0] != "--out" or argv[2] != "--":
        raise SystemExit("usage: megatron_lm_writer.py --out DIR -- <Megatron-LM flags>")
    return argv[1], argv[3:]


def main(argv: List[str]) -> None:
    from megatron.core.enums import ModelType

    out, flags = split_argv(argv)
    args = parse_flags(flags)
    initialize(args)
    model, optimizer, scheduler = build(args)
    args.iteration = 0  # setup_model_and_optimizer, without --load
    args.num_floating_point_operations_so_far = 0
    args.consumed_train_samples = args.skipped_train_samples = args.consumed_valid_samples = 0
    args.model_type = ModelType.encoder_or_decoder  # get_model
    train(args, model, optimizer, scheduler)
    flops = float(args.train_iters * flops_per_iteration(args))
    save_torch_dist(os.path.join(out, "torch_dist"), args, model, optimizer, scheduler, flops)
    save_torch(os.path.join(out, "torch"), args, model, optimizer, scheduler, flops)
    save_torch_dist(
        os.path.join(out, "reference"),
        args,
        model,
        optimizer,
        scheduler,
        flops,
        dist_ckpt_optim_fully_reshardable=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
