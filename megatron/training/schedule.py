"""The learning-rate schedule's lengths and the global batch size's
ramp-up, as Megatron-LM counts them (pure)."""

from typing import List, Optional

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


def interleaving_problem(microbatches: int, pipeline: int, group: int) -> Optional[str]:
    """Why megatron-core's interleaved schedule cannot run ``microbatches``
    per replica at pipeline size ``pipeline`` with microbatch groups of
    ``group`` (its own rule: a group is at least a pipeline's worth and at
    most the microbatches; a last, partial group is empty or at least a
    pipeline's worth); None when it can."""
    if group < pipeline:
        return (
            f"--microbatch-group-size-per-virtual-pipeline-stage {group} is below "
            f"--pipeline-model-parallel-size {pipeline}"
        )
    if microbatches < group:
        return (
            f"{microbatches} microbatch(es) per replica, fewer than a group of {group} "
            "(--microbatch-group-size-per-virtual-pipeline-stage, default the pipeline size)"
        )
    rest = microbatches % group
    if 0 < rest < pipeline:
        return (
            f"{microbatches} microbatches per replica leave a last group of {rest}, "
            f"fewer than the pipeline's {pipeline} stages (groups of {group})"
        )
    return None


def interleaving_problem_at(config: Config, data_parallel_size: int) -> Optional[str]:
    """Why the interleaved schedule (virtual pipeline stages) cannot run
    every replica's share of every global batch of the run (the ramp's
    too) at this data-parallel size; None when it can, or when the run
    has no virtual stages. Shares are uneven after a shrink."""
    if config.virtual_pipeline_model_parallel_size is None:
        return None
    p, mbs = config.parallel, config.batch.micro_batch_size
    pipeline = p.pipeline_model_parallel_size
    group = p.microbatch_group_size_per_vp_stage or pipeline
    for size in GlobalBatch(config).steps():
        slots = size // mbs
        shares = {slots // data_parallel_size, -(-slots // data_parallel_size)}
        for share in sorted(shares):
            problem = interleaving_problem(share, pipeline, group)
            if problem:
                where = f"a global batch of {size} at data-parallel size {data_parallel_size}"
                return f"{where}: {problem}"
    return None


class GlobalBatch:
    """The global batch size at each point of training: Megatron-LM's
    --rampup-batch-size, counted by megatron-core's calculator.

    A pure function of the samples consumed, so a resumed or recovered run
    and a shrunk one (fewer replicas, uneven quotas) take the failure-free
    run's batches: the microbatch count of every iteration is the same."""

    def __init__(self, config: Config):
        b = config.batch
        self.final = b.global_batch_size
        self._ramp = None
        if b.rampup_batch_size:
            from megatron.core.num_microbatches_calculator import (
                RampupBatchsizeNumMicroBatchesCalculator,
            )

            start, increment, samples = b.rampup_batch_size
            self.ramp_samples = samples
            # data-parallel size 1, checks off: every step of the ramp is
            # checked against the launched DP size before training
            # (arguments.py); rank 1 keeps the calculator from logging.
            self._ramp = RampupBatchsizeNumMicroBatchesCalculator(
                b.global_batch_size, b.micro_batch_size, 1, False, 1, start, increment, samples
            )

    @property
    def ramps(self) -> bool:
        return self._ramp is not None

    def at(self, consumed_samples: int) -> int:
        if self._ramp is None:
            return self.final
        self._ramp.update(consumed_samples, consistency_check=False)
        return self._ramp.get_current_global_batch_size()

    def steps(self) -> List[int]:
        """Every batch size of the ramp, the final one last."""
        if self._ramp is None:
            return [self.final]
        r = self._ramp
        return list(range(r.start_global_batch_size, self.final + 1, r.batch_size_increment))

    def iterations(self, train_samples: int) -> int:
        """Megatron-LM's count of iterations for --train-samples: the ramp's
        iterations (the last may pass the ramp's end), then whole final
        batches; a partial last batch is dropped."""
        if self._ramp is None:
            return train_samples // self.final
        iterations = consumed = 0
        while consumed <= self.ramp_samples and consumed <= train_samples:
            consumed += self.at(consumed)
            iterations += 1
        return iterations + max(0, train_samples - consumed) // self.final
