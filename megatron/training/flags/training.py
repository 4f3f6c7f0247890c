"""Checks of the training loop: its length, the learning-rate schedule,
recompute, result validation, determinism and the garbage collector."""

import os

from megatron.training.config import Config
from megatron.training.flags import host
from megatron.training.flags.refusal import ignored_without, require
from megatron.training.schedule import schedule_in_samples


def check(config: Config) -> None:
    t, log = config.training, config.logging
    _check_result_validation(config)
    require(t.lr >= 0 and t.min_lr >= 0, "--lr and --min-lr must be non-negative")
    samples = t.train_samples is not None
    require(
        t.train_iters > 0,
        f"--train-samples {t.train_samples} is less than one global batch "
        f"({config.batch.global_batch_size})"
        if samples
        else "--train-iters must be positive",
    )
    # As Megatron-LM: the schedule is given in iterations or in samples, not both.
    unit, other = ("samples", "iters") if samples else ("iters", "samples")
    for name, unset in (("lr_decay", None), ("lr_warmup", 0), ("lr_wsd_decay", None)):
        require(
            getattr(t, f"{name}_{other}") == unset,
            f"--{name.replace('_', '-')}-{other} goes with --train-{other}; with "
            f"--train-{unit} give --{name.replace('_', '-')}-{unit}",
        )
    warmup_flag = f"--lr-warmup-{unit}"
    require(
        t.lr_warmup_fraction is None or getattr(t, f"lr_warmup_{unit}") == 0,
        f"give only one of --lr-warmup-fraction and {warmup_flag}",
    )
    require(
        t.lr_warmup_fraction is None or 0 <= t.lr_warmup_fraction < 1,
        f"--lr-warmup-fraction {t.lr_warmup_fraction} must be in [0, 1)",
    )
    steps = schedule_in_samples(config)
    require(
        steps["warmup"] < steps["decay"],
        f"warm-up ({steps['warmup']:g} samples) must be shorter than the decay "
        f"({steps['decay']:g} samples): lower {warmup_flag} or raise --lr-decay-{unit}",
    )
    require(
        t.lr_decay_style != "WSD" or steps["wsd"] is not None,
        f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}",
    )
    ignored_without(
        "--decoupled-lr",
        t.decoupled_lr is not None,
        [("--decoupled-min-lr", t.decoupled_min_lr is not None)],
    )
    require(t.manual_gc_interval >= 0, "--manual-gc-interval must be >= 0")
    require(
        t.manual_gc or (t.manual_gc_interval == 0 and t.manual_gc_eval),
        "--manual-gc-interval and --no-manual-gc-eval go with --manual-gc",
    )
    require(log.log_interval > 0, "--log-interval must be positive")
    require(log.eval_interval > 0, "--eval-interval must be positive")


def _check_result_validation(config: Config) -> None:
    t = config.training
    require(t.error_injection_rate >= 0, "--error-injection-rate must be >= 0 (0: never)")
    interval = t.check_weight_hash_across_dp_replicas_interval
    require(
        interval is None or interval > 0,
        "--check-weight-hash-across-dp-replicas-interval must be positive",
    )
    ignored_without(
        "--rerun-mode validate_results or report_stats",
        t.rerun_mode != "disabled",
        [
            ("--error-injection-rate", t.error_injection_rate > 0),
            ("--error-injection-type", t.error_injection_type != "transient_error"),
        ],
    )
    path = t.result_rejected_tracker_filename
    require(
        path is None or host.can_append(path),
        f"--result-rejected-tracker-filename {path} cannot be appended to (its directory "
        "is missing or not writable): choose another file",
    )


def check_recompute(config: Config) -> None:
    t, p = config.training, config.parallel
    # As Megatron-LM (megatron-core reads them only with a granularity).
    ignored_without(
        "--recompute-granularity",
        t.recompute_granularity is not None,
        [
            ("--recompute-method", t.recompute_method is not None),
            ("--recompute-num-layers", t.recompute_num_layers is not None),
            ("--recompute-modules", t.recompute_modules is not None),
        ],
    )
    # Megatron-LM's own rules; megatron-core checks the rest below.
    require(
        t.recompute_granularity != "selective" or t.recompute_method is None,
        "--recompute-method goes with --recompute-granularity full (selective recompute "
        "takes --recompute-modules): drop it",
    )
    require(
        not t.distribute_saved_activations
        or (t.recompute_granularity == "full" and p.tensor_model_parallel_size > 1),
        "--distribute-saved-activations splits full recompute's kept inputs over the "
        "tensor-parallel group: it needs --recompute-granularity full and TP > 1",
    )


def check_determinism(config: Config) -> None:
    """As Megatron-LM: a deterministic run uses no kernel known not to be, and
    on a GPU NCCL's all-reduce algorithm is named."""
    if not config.training.deterministic_mode:
        return
    require(
        not config.model.cross_entropy_loss_fusion,
        "--deterministic-mode: the fused cross entropy is not deterministic: drop "
        "--cross-entropy-loss-fusion",
    )
    require(
        not config.model.use_flash_attn,
        "--deterministic-mode: Megatron-LM refuses --use-flash-attn with it: drop one",
    )
    algorithms = ("Tree", "Ring", "CollnetDirect", "CollnetChain", "^NVLS")
    require(
        config.parallel.distributed_backend != "nccl" or os.environ.get("NCCL_ALGO") in algorithms,
        f"--deterministic-mode on GPUs: set NCCL_ALGO to one of {', '.join(algorithms)} "
        f"(now {os.environ.get('NCCL_ALGO', 'unset')})",
    )


def check_schedule_source(config: Config) -> None:
    c = config.checkpoint
    require(
        not (c.use_checkpoint_opt_param_scheduler and c.override_opt_param_scheduler),
        "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler say opposite "
        "things: give one",
    )
