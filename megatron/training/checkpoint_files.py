"""Where a checkpoint lies and in which format, told from its files alone
(no process group, no tensor read). Both of Megatron-LM's formats share
the layout of a root::

    {root}/latest_checkpointed_iteration.txt     the iteration, or "release"
    {root}/iter_{iteration:07d}/                   one save (or {root}/release/)
    {root}/non_persistent/                         --non-persistent-ckpt-type global

A save's directory tells its format as Megatron-LM tells it: torch_dist
has ``metadata.json``, the legacy torch format per-rank ``mp_rank_0*``
entries. The trainer finds here what to load and hands it to the one
entrance for loading, ``checkpointing.load_checkpoint``, whose readers
(torch_dist there, the legacy format in legacy_checkpoint.py) hand back
``SaveContents``; saving.py names its saves with the same names.
"""

import argparse
import dataclasses
import os
from typing import Optional

import torch
from megatron.core import dist_checkpointing

from megatron.training.config import TRACKER

NON_PERSISTENT = "non_persistent"  # Megatron-LM's subdirectory of --save for them


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message says what is wrong."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def checkpoint_dir(root: str, entry: str) -> str:
    return os.path.join(root, "release") if entry == "release" else iteration_dir(root, int(entry))


def read_tracker(root: str) -> Optional[str]:
    """The tracker's entry: an iteration number or ``release``; None without one."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        entry = f.read().strip()
    if entry != "release" and not entry.isdigit():
        raise CheckpointError(f"{path} holds {entry!r}, neither an iteration number nor 'release'")
    return entry


def tracked_iteration(root: Optional[str]) -> Optional[int]:
    """The iteration the tracker in ``root`` names (a release counts as 0)."""
    entry = None if root is None else read_tracker(root)
    return None if entry is None else 0 if entry == "release" else int(entry)


def non_persistent_dir(c, root: Optional[str]) -> Optional[str]:
    """Where global non-persistent checkpoints of ``root`` (--save or --load) go."""
    if c.non_persistent_global_ckpt_dir or root is None:
        return c.non_persistent_global_ckpt_dir
    return os.path.join(root, NON_PERSISTENT)


def root_to_load(c) -> Optional[str]:
    """--load, or its non-persistent checkpoints when they are as new or newer
    (as Megatron-LM, with --non-persistent-ckpt-type global)."""
    if c.non_persistent_ckpt_type != "global":
        return c.load
    candidate = non_persistent_dir(c, c.load)
    newest = tracked_iteration(candidate)
    if newest is not None and newest >= (tracked_iteration(c.load) or -1):
        return candidate
    return c.load


def is_legacy(directory: str) -> bool:
    """Megatron-LM's test: not torch_dist, and per-rank ``mp_rank_0*`` entries."""
    if not os.path.isdir(directory) or dist_checkpointing.check_is_distributed_checkpoint(
        directory
    ):
        return False
    return any(name.startswith("mp_rank_0") for name in os.listdir(directory))


@dataclasses.dataclass(frozen=True)
class Found:
    """The save a root's tracker names, and its format."""

    root: str
    directory: str
    release: bool
    legacy: bool  # Megatron-LM's legacy --ckpt-format torch, else torch_dist


def saved_in(root: Optional[str]) -> Optional[Found]:
    """The save the tracker in ``root`` names; None without a root or a tracker."""
    entry = read_tracker(root) if root else None
    if entry is None:
        return None
    directory = checkpoint_dir(root, entry)
    return Found(root, directory, entry == "release", is_legacy(directory))


def checkpoint_to_load(c) -> Optional[Found]:
    """The save --load names (or its non-persistent one, see root_to_load)."""
    return saved_in(root_to_load(c))


def torch_dist_args(directory: str) -> argparse.Namespace:
    """The ``args`` (Megatron-LM's Namespace) of the torch_dist save in ``directory``."""
    return torch.load(os.path.join(directory, "common.pt"), weights_only=False)["args"]


@dataclasses.dataclass
class SaveContents:
    """What a format's reader took from a save beside the tensors it put
    back, for checkpointing.load_checkpoint to restore alike in both
    formats: the save's top-level state under Megatron-LM's keys
    (iteration, args, ...), and, where they are loaded (else None), the
    scheduler's state and this rank's RNG states."""

    top: dict
    scheduler: Optional[dict]
    rng: Optional[list]
