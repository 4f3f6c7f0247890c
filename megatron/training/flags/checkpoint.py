"""Checks of checkpointing: what --save writes and when, what --load
and --pretrained-checkpoint read."""

import os

from megatron.training.config import TRACKER, Config
from megatron.training.flags import host
from megatron.training.flags.refusal import ignored_without, require, warn


def check(config: Config) -> None:
    c = config.checkpoint
    require(c.save_interval is None or c.save_interval > 0, "--save-interval must be positive")
    _check_save_retention(config)
    if c.ckpt_fully_parallel_save_deprecated:
        warn(
            "--ckpt-fully-parallel-save is deprecated and has no effect (Megatron-LM says so "
            "too): fully parallel saves are the default; --no-ckpt-fully-parallel-save "
            "turns them off"
        )
    if c.async_save and c.save and not c.use_persistent_ckpt_worker:
        warn(
            "--async-save without --use-persistent-ckpt-worker: saves are synchronous, as "
            "Megatron-LM makes them; add --use-persistent-ckpt-worker to write in the "
            "background"
        )
        c.async_save = False
    ignored_without(
        "--save",
        bool(c.save),
        [
            ("--save-interval", c.save_interval is not None),
            ("--async-save", c.async_save),
            ("--non-persistent-save-interval", c.non_persistent_save_interval is not None),
        ],
    )
    ignored_without(
        "--load", bool(c.load), [("--exit-on-missing-checkpoint", c.exit_on_missing_checkpoint)]
    )
    require(
        c.non_persistent_save_interval is None or c.non_persistent_save_interval > 0,
        "--non-persistent-save-interval must be positive",
    )
    require(
        c.non_persistent_save_interval is None or c.non_persistent_ckpt_type == "global",
        "--non-persistent-save-interval needs --non-persistent-ckpt-type global",
    )
    require(
        c.non_persistent_ckpt_type in (None, "global"),
        f"--non-persistent-ckpt-type {c.non_persistent_ckpt_type} is not available here "
        "(local and in_memory need nvidia-resiliency-ext's local checkpoint manager, which "
        "DeadPool's in-memory buddy mirror replaces): use global",
    )
    require(not c.use_checkpoint_args or c.load, "--use-checkpoint-args needs --load DIR")
    require(
        c.pretrained_checkpoint is None
        or os.path.exists(os.path.join(c.pretrained_checkpoint, TRACKER)),
        f"--pretrained-checkpoint {c.pretrained_checkpoint} holds no checkpoint (no {TRACKER} "
        "in it): name the directory given to --save when it was written",
    )
    require(
        c.save is None or host.can_create(c.save),
        f"--save {c.save} cannot be written (a file stands in its path, or a directory "
        "on it is not writable): choose another directory",
    )
    # --load tells a checkpoint's format from its files (torch_dist, or Megatron-LM's
    # legacy torch); --ckpt-format says what --save writes.
    if c.ckpt_format == "torch" and c.save:
        _check_legacy_save(config)
    require(
        c.ckpt_format in ("torch", "torch_dist"),
        f"--ckpt-format {c.ckpt_format} cannot be written or read here (torch_dcp and "
        "fsdp_dtensor belong to FSDP): use --ckpt-format torch_dist (the default)",
    )


def _check_save_retention(config: Config) -> None:
    c = config.checkpoint
    if c.save_retain_interval is None:
        return
    require(c.save_retain_interval > 0, "--save-retain-interval must be positive")
    require(
        c.save_interval is not None and c.save_retain_interval % c.save_interval == 0,
        f"--save-retain-interval {c.save_retain_interval} must be a multiple of "
        f"--save-interval (now {c.save_interval}): change one of them",
    )


def _check_legacy_save(config: Config) -> None:
    """What --save with --ckpt-format torch (Megatron-LM's per-rank files)
    cannot write here, or Megatron-LM cannot either."""
    require(
        not config.checkpoint.async_save,
        "--async-save with --ckpt-format torch: Megatron-LM writes its legacy format in the "
        "foreground only; drop --async-save or save torch_dist (the default)",
    )
    require(
        config.parallel.expert_model_parallel_size == 1,
        "--save with --ckpt-format torch and --expert-model-parallel-size "
        f"{config.parallel.expert_model_parallel_size}: the legacy files are written here without "
        "expert parallelism only; save torch_dist (the default)",
    )
