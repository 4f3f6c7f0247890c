"""Megatron-LM's timers (--timing-log-level), on megatron-core's Timers.

megatron-core's schedules, gradient reduction and optimizer time
themselves with its Timers once given one; the training step adds
'optimizer'. Every log line is followed by the timers' (min, max) over
ranks, as Megatron-LM."""

from typing import Dict, List

from megatron.core.timers import Timers

from megatron.training.config import Config

# Megatron-LM's lists, by level.
STEP_TIMERS = [
    "forward-backward",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "all-grads-sync",
    "params-all-gather",
    "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad",
    "optimizer-count-zeros",
    "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
    "optimizer",
]
MICROBATCH_TIMERS = [
    "batch-generator",
    "forward-compute",
    "backward-compute",
    "forward-recv",
    "forward-send",
    "backward-recv",
    "backward-send",
    "forward-send-forward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
]


def build_timers(config: Config) -> Timers:
    log = config.logging
    return Timers(log.timing_log_level, log.timing_log_option)


def timer_names(level: int) -> List[str]:
    return (STEP_TIMERS if level >= 1 else []) + (MICROBATCH_TIMERS if level >= 2 else [])


def timer_scalars(timers: Timers, level: int, iterations: int) -> Dict[str, float]:
    """Megatron-LM's dashboard scalars: 'NAME-time', the max over ranks in
    seconds per iteration (as Megatron-LM writes them). Collective (every
    rank gathers every rank's times); the timers keep running for the log
    that follows."""
    # megatron-core's Timers.write takes only its own writer types; the
    # (min, max) it writes from is this.
    spans = timers._get_global_min_max_time(timer_names(level), False, False, iterations)
    return {f"{name}-time": longest for name, (_, longest) in spans.items()}
