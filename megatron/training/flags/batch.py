"""Checks of the batch: micro and global batch sizes over the
data-parallel ranks, and --rampup-batch-size's ramp."""

from typing import Optional

from megatron.training.config import Config
from megatron.training.flags.refusal import require
from megatron.training.schedule import GlobalBatch


def check(config: Config) -> None:
    b, dp = config.batch, config.data_parallel_size
    require(b.micro_batch_size > 0, "--micro-batch-size must be positive")
    step = b.micro_batch_size * dp
    require(
        b.global_batch_size % step == 0,
        f"--global-batch-size {b.global_batch_size} is not divisible by "
        f"--micro-batch-size {b.micro_batch_size} x data-parallel size {dp} = {step}: "
        f"use a multiple of {step}",
    )
    if b.rampup_batch_size is not None:
        _check_ramp(config)


def _check_ramp(config: Config) -> None:
    b, dp = config.batch, config.data_parallel_size
    problem = _ramp_problem(config)
    require(problem is None, problem or "")
    step = b.micro_batch_size * dp
    uneven = [size for size in GlobalBatch(config).steps() if size % step]
    require(
        not uneven,
        f"--rampup-batch-size reaches batch sizes {uneven[:4]} that --micro-batch-size "
        f"{b.micro_batch_size} x data-parallel size {dp} = {step} does not divide: use a "
        f"start and an increment that are multiples of {step}",
    )


def ramp_is_sound(config: Config) -> bool:
    return config.batch.rampup_batch_size is None or _ramp_problem(config) is None


def _ramp_problem(config: Config) -> Optional[str]:
    """What is wrong with --rampup-batch-size START INCREMENT SAMPLES, if anything."""
    b = config.batch
    start, increment, samples = b.rampup_batch_size
    if config.training.train_samples is None:
        return (
            "--rampup-batch-size goes with --train-samples (as Megatron-LM): give the "
            "run's length in samples"
        )
    if not 0 < start < b.global_batch_size:
        return (
            f"--rampup-batch-size starts at {start}: give a start between 0 and "
            f"--global-batch-size {b.global_batch_size}, both excluded"
        )
    if increment <= 0 or (b.global_batch_size - start) % increment:
        return (
            f"--rampup-batch-size's increment {increment} must be positive and divide "
            f"--global-batch-size {b.global_batch_size} - start {start}"
        )
    if samples <= 0:
        return f"--rampup-batch-size's ramp of {samples} samples must be positive"
    return None
