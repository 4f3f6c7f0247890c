"""What a recovered run must equal in the failure-free one: the tests and
the fault campaign (tools/chaos.py) judge runs by these."""

import json
from typing import Dict, List, Optional

import numpy as np
import torch


def read_metrics(path: str) -> List[dict]:
    """The per-iteration records of ``--metrics-file``."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def curve(metrics: List[dict]) -> List[tuple]:
    """What must match bit for bit: per iteration loss, grad norm, lr, and
    the auxiliary losses (an MoE model's load balancing and z-loss, the
    multi-token prediction layers')."""
    return [
        (m["iteration"], m["lm_loss"], m["grad_norm"], m["lr"], *_aux_losses(m)) for m in metrics
    ]


# How far a shrunk run may drift from the failure-free one, relative, per
# iteration, on loss and grad norm: the same samples and weights, with the
# fp32 reductions over the replicas taken in another order.
SHRINK_TOLERANCE = 1e-5


def curve_difference(got: List[dict], want: List[dict]) -> Optional[str]:
    """None when two runs' curves are equal bit for bit, else the first
    iteration where they differ."""
    if [m["iteration"] for m in got] != [m["iteration"] for m in want]:
        return (
            f"iterations {[m['iteration'] for m in got]} against {[m['iteration'] for m in want]}"
        )
    for ours, theirs in zip(curve(got), curve(want)):
        if ours != theirs:
            return f"iteration {ours[0]}: {ours[1:]} against {theirs[1:]}"
    return None


def shrink_difference(
    got: List[dict], want: List[dict], fault_iteration: int, rank_drawn_dropout: bool = False
) -> Optional[str]:
    """None when a shrunk run kept the failure-free one's course: the same
    iterations, samples and lr, and loss and grad norm within
    SHRINK_TOLERANCE. With dropout drawn from each rank's stream
    (--no-deadpool-sample-rng), a moved microbatch draws other masks: then
    equal up to the iteration before the fault, and finite after."""
    if [m["iteration"] for m in got] != [m["iteration"] for m in want]:
        return f"iterations {[m['iteration'] for m in got]}"
    for g, w in zip(got, want):
        if g["consumed_samples"] != w["consumed_samples"] or g["lr"] != w["lr"]:
            return f"iteration {g['iteration']}: samples or lr differ"
        for key in ("lm_loss", "grad_norm"):
            if rank_drawn_dropout and g["iteration"] >= fault_iteration - 1:
                bad = not abs(g[key]) < float("inf")
            else:
                bad = abs(g[key] - w[key]) > SHRINK_TOLERANCE * abs(w[key])
            if bad:
                return f"iteration {g['iteration']}: {key} {g[key]} vs {w[key]}"
    return None


def _aux_losses(line: dict) -> List[tuple]:
    """The routers' losses ('load_balancing_loss', ...) and the multi-token
    prediction layers' ('mtp_1 loss', ...)."""
    return sorted(
        (k, v) for k, v in line.items() if k.endswith(("_loss", " loss")) and k != "lm_loss"
    )


def model_tensors(state: Dict[str, object]) -> Dict[str, torch.Tensor]:
    """The model's tensors of a ``checkpoint_state`` state (no optimizer)."""
    return {k: v for k, v in state.items() if torch.is_tensor(v) and not k.startswith("optimizer.")}


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
    if isinstance(a, np.ndarray):
        return None if np.array_equal(a, b) else f"{path}: values differ"
    if torch.is_tensor(a):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: dtype/shape differ"
        return None if torch.equal(a, b) else f"{path}: values differ"
    return None if a == b else f"{path}: {a!r} != {b!r}"
