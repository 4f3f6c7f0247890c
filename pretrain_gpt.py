"""Pretrain GPT on megatron-core: the model, batch and loss providers of the user's entry point.

Run like Megatron-LM's script, under torchrun (or deadpool-launch):

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 128 \
        --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 \
        --global-batch-size 8 --train-iters 50 --lr 1e-3 \
        --data-path data/corpus_text_document --tokenizer-type ByteLevelTokenizer

This file holds only the GPT-specific providers; the loop is in
megatron/training.
"""

import sys
from functools import partial


def layer_spec(config, tf_config, on_cpu: bool, vp_stage=None):
    """The GPT layers' spec: Transformer Engine's layers when they are there
    and wanted, else megatron-core's local ones (with torch's SDPA as the
    core attention where --attention-backend asks for it); an MoE model's
    block spec, as Megatron-LM's builder."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    from megatron.training.model_setup import use_transformer_engine, with_run_attention

    m = config.model
    use_te = use_transformer_engine(config, on_cpu)
    if config.moe.num_experts:
        spec = get_gpt_decoder_block_spec(
            tf_config,
            use_transformer_engine=use_te,
            normalization=m.normalization,
            vp_stage=vp_stage,
        )
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=m.qk_layernorm, multi_latent_attention=m.multi_latent_attention
        )
    else:
        spec = get_gpt_layer_local_spec(
            normalization=m.normalization,
            qk_layernorm=m.qk_layernorm,
            multi_latent_attention=m.multi_latent_attention,
        )
    return with_run_attention(spec, config, on_cpu)


def mtp_block_spec(config, tf_config, on_cpu: bool, vp_stage=None):
    """The multi-token-prediction layers' spec on the stage that holds them
    (the last one), else None: each MTP layer is built as the model's last
    decoder layer, as Megatron-LM's builder does."""
    if config.model.mtp_num_layers is None:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    from megatron.training.model_setup import use_transformer_engine, with_run_attention

    m, use_te = config.model, use_transformer_engine(config, on_cpu)
    if config.moe.num_experts:
        last = get_gpt_decoder_layer_specs(
            tf_config, use_transformer_engine=use_te, normalization=m.normalization
        )[-1]
    else:
        last = layer_spec(config, tf_config, on_cpu, vp_stage)
    return get_gpt_mtp_block_spec(
        tf_config, with_run_attention(last, config, on_cpu), use_te, vp_stage=vp_stage
    )


def model_provider(config, tf_config, pre_process: bool, post_process: bool, vp_stage=None):
    """This rank's stage of the GPT model; with virtual pipeline stages, its
    chunk ``vp_stage``."""
    from megatron.core.models.gpt import GPTModel

    m = config.model
    return GPTModel(
        config=tf_config,
        transformer_layer_spec=layer_spec(config, tf_config, config.run.on_cpu, vp_stage),
        vocab_size=config.run.padded_vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        mtp_block_spec=mtp_block_spec(config, tf_config, config.run.on_cpu, vp_stage),
        vp_stage=vp_stage,
    )


def get_batch(data_iterator):
    """The next microbatch on this rank's device, or Nones on middle stages."""
    import torch  # here, not at the top: --help answers before torch is imported

    if data_iterator is None:
        return None, None, None, None, None
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = next(data_iterator)
    moved = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    # With context parallelism: this rank's two chunks of each sequence (no-op without).
    moved = get_batch_on_this_cp_rank(moved)
    return (
        moved["tokens"],
        moved["labels"],
        moved["loss_mask"],
        moved.get("attention_mask"),
        moved["position_ids"],
    )


# As Megatron-LM: a loss this many times the largest seen is spiky.
SPIKY_LOSS_FACTOR = 10


def loss_func(loss_mask, output_tensor, check_for_nan: bool = True, check_for_spike=False):
    """Megatron-LM's: the microbatch's loss summed over its tokens, their
    count, and both for the log. megatron-core's schedule divides the sum by
    the count unless --calculate-per-token-loss (then the gradients are
    divided by the whole batch's tokens). With --check-for-nan-in-loss-and-grad
    (the default) a NaN or Inf local loss is a rejected result (fatal), and
    with --check-for-spiky-loss a spiky one (not fatal): --rerun-mode says
    what follows, as Megatron-LM."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    if check_for_nan:  # before the data-parallel reduction, on this rank's loss
        machine = get_rerun_state_machine()
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,
                fatal=True,
            )
    if check_for_spike:
        machine = get_rerun_state_machine()
        machine.validate_result(
            result=loss,
            rejection_func=partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    # clone: the schedule divides the returned loss in place.
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step(
    data_iterator,
    model,
    check_for_nan: bool = True,
    check_for_spike=False,
    return_schedule_plan: bool = False,
):
    """The microbatch's output and its loss function; with
    return_schedule_plan (megatron-core's combined 1F1B schedule, under
    --overlap-moe-expert-parallel-comm) the model's plan of the same forward
    in its place, which the schedule runs."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    checks = dict(check_for_nan=check_for_nan, check_for_spike=check_for_spike)
    # The loss mask too: multi-token prediction's losses are masked by it.
    run = model.build_schedule_plan if return_schedule_plan else model
    output = run(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask, **checks)


def main(argv=None) -> int:
    # The flags first: --help and bad flags answer before torch and megatron-core
    # are imported (parsing imports megatron-core itself, as below, only for the
    # checks that need it, after every other).
    from megatron.training.arguments import ConfigError

    from deadpool_ext.config import parse_args

    try:
        config = parse_args(argv)
    except ConfigError as error:
        print(f"pretrain_gpt.py: error: {error}", file=sys.stderr)
        return ConfigError.EXIT_CODE
    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core_without_cuda()  # before anything else imports it
    from megatron.training.tokenizer import import_for_rank

    import_for_rank(config.tokenizer)
    from deadpool_ext.entry import run_training

    t = config.training
    step = partial(
        forward_step,
        check_for_nan=t.check_for_nan_in_loss_and_grad,
        check_for_spike=t.check_for_spiky_loss,
    )
    try:
        return run_training(config, model_provider, step)
    except ConfigError as error:
        print(f"pretrain_gpt.py: error: {error}", file=sys.stderr)
        return ConfigError.EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
