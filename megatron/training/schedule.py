"""The learning-rate schedule's lengths, as Megatron-LM counts them (pure)."""

from megatron.training.config import Config


def schedule_in_samples(config: Config) -> dict:
    """Megatron-LM counts schedule steps in samples: with --train-iters the
    iteration flags times the global batch, with --train-samples the sample
    flags as they are; a warm-up fraction is of the decay (not rounded)."""
    t, gbs = config.training, config.batch.global_batch_size
    if t.train_samples is not None:
        decay = t.lr_decay_samples or t.train_samples
        warmup, wsd, total = t.lr_warmup_samples, t.lr_wsd_decay_samples, t.train_samples
    else:
        decay, warmup, total = t.lr_decay_iters * gbs, t.lr_warmup_iters * gbs, t.train_iters * gbs
        wsd = t.lr_wsd_decay_iters * gbs if t.lr_wsd_decay_iters else None
    if t.lr_warmup_fraction is not None:
        warmup = t.lr_warmup_fraction * decay
    return {"warmup": warmup, "decay": decay, "wsd": wsd, "total": total}
