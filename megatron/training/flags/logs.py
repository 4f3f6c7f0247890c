"""Checks of logging and profiling: the log level, TensorBoard and W&B,
and the profiler's range."""

import os

from megatron.training.config import Config
from megatron.training.flags import host
from megatron.training.flags.refusal import ignored_without, require


def check(config: Config) -> None:
    log = config.logging
    _check_profile(config)
    level = os.environ.get("MEGATRON_LOGGING_LEVEL")
    require(
        log.logging_level is not None or not level or level.lstrip("-").isdigit(),
        f"MEGATRON_LOGGING_LEVEL={level} is no logging level: give a number (10 DEBUG, "
        "20 INFO, 30 WARNING, 40 ERROR, 50 CRITICAL) or unset it",
    )
    require(log.tensorboard_log_interval > 0, "--tensorboard-log-interval must be positive")
    require(log.tensorboard_queue_size > 0, "--tensorboard-queue-size must be positive")
    dashboard = bool(log.tensorboard_dir or log.wandb_project)
    names = (
        "log_timers_to_tensorboard",
        "log_validation_ppl_to_tensorboard",
        "log_memory_to_tensorboard",
        "log_world_size_to_tensorboard",
    )
    ignored_without(
        "--tensorboard-dir or --wandb-project",
        dashboard,
        [("--" + name.replace("_", "-"), getattr(log, name)) for name in names]
        + [("--no-log-loss-scale-to-tensorboard", not log.log_loss_scale_to_tensorboard)],
    )
    require(
        not (dashboard and log.log_memory_to_tensorboard)
        or config.parallel.distributed_backend == "nccl",
        "--log-memory-to-tensorboard reads the CUDA allocator's statistics: there is none "
        "on CPU; drop it",
    )
    if log.tensorboard_dir:
        _require_package("tensorboard", "--tensorboard-dir")
        require(
            host.can_create(log.tensorboard_dir),
            f"--tensorboard-dir {log.tensorboard_dir} cannot be written: choose another directory",
        )
    for name in ("wandb_exp_name", "wandb_save_dir", "wandb_entity"):
        require(
            log.wandb_project or getattr(log, name) is None,
            f"--{name.replace('_', '-')} goes with --wandb-project NAME",
        )
    if log.wandb_project:
        from megatron.training.dashboards import wandb_directory

        _require_package("wandb", "--wandb-project")
        directory = wandb_directory(config)
        require(
            directory is not None,
            "--wandb-project needs --wandb-save-dir DIR or --save DIR (runs go to SAVE/wandb)",
        )
        require(
            host.can_create(directory),
            f"W&B's directory {directory} cannot be written: choose another",
        )


def _check_profile(config: Config) -> None:
    log = config.logging
    if not log.profile:
        ignored_without(
            "--profile",
            False,
            [
                ("--profile-step-start", log.profile_step_start != 10),
                ("--profile-step-end", log.profile_step_end != 12),
                ("--use-pytorch-profiler", log.use_pytorch_profiler),
                ("--profile-ranks", log.profile_ranks != [0]),
            ],
        )
        return
    require(
        0 <= log.profile_step_start < log.profile_step_end,
        f"--profile-step-start {log.profile_step_start} must be below --profile-step-end "
        f"{log.profile_step_end} (and not negative)",
    )
    if log.use_pytorch_profiler:
        require(
            log.tensorboard_dir is not None,
            "--use-pytorch-profiler writes its traces to --tensorboard-dir: give one",
        )
    else:
        require(
            config.parallel.distributed_backend == "nccl",
            "--profile without --use-pytorch-profiler opens a CUDA profiler range for nsys, "
            "which needs a GPU: add --use-pytorch-profiler here (traces to --tensorboard-dir)",
        )


def _require_package(module: str, flag: str) -> None:
    require(
        host.importable(module),
        f"{flag} needs the python package '{module}': `pip install {module}`, or drop {flag}",
    )
