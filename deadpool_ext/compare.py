"""What a recovered run must equal in the failure-free one: the tests and
the fault campaign (tools/chaos.py) judge runs by these."""

import json
import os
from typing import Dict, List, Optional

import torch


def read_metrics(path: str) -> List[dict]:
    """The per-iteration records of ``--metrics-file``."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def curve(metrics: List[dict]) -> List[tuple]:
    """What must match bit for bit: per iteration loss, grad norm, lr."""
    return [(m["iteration"], m["lm_loss"], m["grad_norm"], m["lr"]) for m in metrics]


def checkpoint_files(directory: str, iteration: Optional[int] = None) -> Dict[str, dict]:
    """Every rank's saved state of an iteration (default: the latest)."""
    if iteration is None:
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as f:
            iteration = int(f.read())
    folder = os.path.join(directory, f"iter_{iteration:07d}")
    return {
        name: torch.load(os.path.join(folder, name), weights_only=True)
        for name in sorted(os.listdir(folder))
    }


def state_difference(a, b, path: str = "") -> Optional[str]:
    """None when two saved states are bitwise equal, else where they first
    differ."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{path}: keys differ"
        return next((d for k in a if (d := state_difference(a[k], b[k], f"{path}/{k}"))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths differ"
        return next(
            (
                d
                for i, (x, y) in enumerate(zip(a, b))
                if (d := state_difference(x, y, f"{path}[{i}]"))
            ),
            None,
        )
    if torch.is_tensor(a):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: dtype/shape differ"
        return None if torch.equal(a, b) else f"{path}: values differ"
    return None if a == b else f"{path}: {a!r} != {b!r}"
