"""Gradient replay (--deadpool-mirror-mode grad): the buddy keeps a replica
of its owner's shard and advances it by the owner's own optimizer step.

Every iteration the owner sends a *packet* instead of its whole state: the
fp32 gradient each main parameter had when the optimizer stepped (after
unscaling and clipping, so the clip coefficient, loss scale and found-inf
are already in it or in whether the step ran), the optimizer's parameter
groups as they were at that step (learning rate, weight decay, betas, ...),
which main parameter sits where in the shard, and the sidecar of the new
iteration with the checksum the owner sealed its own snapshot with. The
buddy copies its last verified replica, runs the same optimizer class on
views of the copy, writes the sidecar and seals it: the seal's checksum is
the digest, and it must equal the owner's, bit for bit, or the replica
diverged. 4 bytes per parameter travel instead of 12.

Layout of a packet (bytes)::

    [header: 8 x int64][grad: N fp32][sidecar | extras][zero pad]

where N and the room for the sidecar are the snapshot layout's, the sidecar
is the owner's snapshot sidecar as sealed, and extras (``torch.save``) hold
the segment table and the parameter groups.
"""

from typing import Dict, List, Optional

import torch

from megatron.training.optimizer_layout import inner_optimizers, steps_per_parameter
from deadpool_ext.state import snapshot as snap
from deadpool_ext.state.digest import unsigned64

PACKET_MAGIC = 0x44504752414450  # "DPGRADP"
# header slots
P_MAGIC, P_ITERATION, P_NUMEL, P_SIDECAR, P_EXTRAS, P_CHECKSUM = range(6)
# Parameter-group entries that travel: the optimizer's scalars and flags.
_SCALARS = (bool, int, float, str, type(None))


class ReplayMismatch(RuntimeError):
    """The replica could not be advanced to the owner's state: it diverged."""


def packet_bytes(layout: snap.ShardLayout) -> int:
    return snap.whole_chunks(snap.HEADER_BYTES + layout.numel * 4 + layout.sidecar_capacity)


def allocate(layout: snap.ShardLayout, device="cpu", pin: bool = False) -> torch.Tensor:
    return snap.zeros(packet_bytes(layout), device, pin)


def grad_region(packet: torch.Tensor, layout: snap.ShardLayout) -> torch.Tensor:
    return packet[snap.HEADER_BYTES : snap.HEADER_BYTES + layout.numel * 4].view(torch.float32)


def _blob(packet: torch.Tensor, layout: snap.ShardLayout) -> torch.Tensor:
    start = snap.HEADER_BYTES + layout.numel * 4
    return packet[start : start + layout.sidecar_capacity]


def header(packet: torch.Tensor) -> torch.Tensor:
    return packet[: snap.HEADER_BYTES].view(torch.int64)


# ----- the owner -----
def segment_table(optimizer, layout: snap.ShardLayout) -> List[List[int]]:
    """Each main parameter's [offset, numel, inner optimizer, parameter
    group], in the layout's order (the sidecar's steps follow it). DP peers
    hold different slices of the buckets, so the buddy cannot work it out
    from its own layout."""
    inner = inner_optimizers(optimizer)
    table = []
    for seg in layout.segments:
        group, _ = inner[seg.optimizer_index].model_param_group_index_map[seg.model_param]
        table.append([seg.offset, seg.numel, seg.optimizer_index, group])
    return table


def param_groups(optimizer) -> List[List[dict]]:
    """Every inner optimizer's parameter groups without their parameters:
    what the step about to run uses (the scheduler changes them after it)."""
    return [
        [_scalars(group) for group in opt.optimizer.param_groups]
        for opt in inner_optimizers(optimizer)
    ]


def _scalars(group: dict) -> dict:
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        values = value if isinstance(value, tuple) else (value,)
        if not all(isinstance(v, _SCALARS) for v in values):
            raise snap.SnapshotError(
                f"--deadpool-mirror-mode grad: the optimizer's parameter group entry "
                f"{key!r} is a {type(value).__name__}, which the buddy cannot replay; "
                "use --deadpool-mirror-mode state"
            )
        out[key] = value
    return out


def pack_grads(optimizer, layout: snap.ShardLayout, packet: torch.Tensor) -> None:
    """Copy every main parameter's gradient (as the last step used it) into
    the packet; a parameter the step left without one gets zeros (its step
    count did not advance, so the replica leaves it alone)."""
    grads = grad_region(packet, layout)
    for seg in layout.segments:
        main, _ = snap.main_param_and_state(optimizer, seg)
        where = grads[seg.offset : seg.offset + seg.numel]
        if main.grad is None:
            where.zero_()
        else:
            where.copy_(main.grad.detach().view(-1), non_blocking=True)


def seal_packet(
    packet: torch.Tensor,
    layout: snap.ShardLayout,
    own: torch.Tensor,
    extras: dict,
) -> None:
    """Header, the owner's sealed sidecar and checksum (from its own snapshot
    ``own`` of the same iteration), and the extras."""
    own_header = snap.header(own)
    sidecar_len = int(own_header[snap.H_SIDECAR])
    encoded = snap.encode_sidecar(extras)
    if sidecar_len + len(encoded) > layout.sidecar_capacity:
        raise snap.SnapshotError(
            f"sidecar and replay extras of {sidecar_len + len(encoded)} bytes exceed the "
            f"reserved {layout.sidecar_capacity}"
        )
    blob = _blob(packet, layout)
    blob[:sidecar_len].copy_(snap.sidecar_area(own, layout)[:sidecar_len])
    blob[sidecar_len : sidecar_len + len(encoded)].copy_(
        torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    )
    h = header(packet)
    h.zero_()
    h[P_MAGIC], h[P_ITERATION], h[P_NUMEL] = (
        PACKET_MAGIC,
        own_header[snap.H_ITERATION],
        layout.numel,
    )
    h[P_SIDECAR], h[P_EXTRAS] = sidecar_len, len(encoded)
    h[P_CHECKSUM] = own_header[snap.H_CHECKSUM]


# ----- the buddy -----
def apply(
    packet: torch.Tensor,
    source: torch.Tensor,
    target: torch.Tensor,
    layout: snap.ShardLayout,
    optimizer_classes: List[type],
    owner: int,
) -> int:
    """Advance the replica ``source`` (verified, iteration t) by the owner's
    step into ``target`` and seal it as the owner's snapshot of t+1. Returns
    the iteration; raises ReplayMismatch when the digests differ (``target``
    is then left unsealed)."""
    h = header(packet).clone()
    if int(h[P_MAGIC]) != PACKET_MAGIC or int(h[P_NUMEL]) != layout.numel:
        raise ReplayMismatch("not a replay packet of this layout")
    iteration, sidecar_len = int(h[P_ITERATION]), int(h[P_SIDECAR])
    blob = _blob(packet, layout)[: sidecar_len + int(h[P_EXTRAS])].cpu().numpy().tobytes()
    sidecar, extras = blob[:sidecar_len], snap.decode_sidecar(blob[sidecar_len:])
    before = snap.read_sidecar(source, layout)["steps"]
    after = snap.decode_sidecar(sidecar)["steps"]
    target.copy_(source)
    snap.header(target)[snap.H_MAGIC] = 0  # not a snapshot until sealed
    views = snap.regions(target, layout)
    if not before:  # the owner had no optimizer state yet: Adam's zeros
        views[1].zero_()
        views[2].zero_()
    _step(views, grad_region(packet, layout), extras, before, after, optimizer_classes)
    snap.seal(target, layout, iteration, owner, sidecar)
    expected, actual = int(h[P_CHECKSUM]), int(snap.header(target)[snap.H_CHECKSUM])
    if actual != expected:
        snap.header(target)[snap.H_MAGIC] = 0
        raise ReplayMismatch(
            f"the replica of iteration {iteration} has digest {unsigned64(actual):#x}, "
            f"its owner's state {unsigned64(expected):#x}"
        )
    return iteration


def _step(
    views: List[torch.Tensor],
    grads: torch.Tensor,
    extras: dict,
    before: List[float],
    after: List[float],
    optimizer_classes: List[type],
) -> None:
    """The owner's optimizer step on views of the replica: one optimizer of
    the owner's class per inner optimizer, its parameter groups as the
    owner's were, each parameter whose step count advanced."""
    table = extras["segments"]
    before = before or [0.0] * len(table)
    if len(after) not in (0, len(table)) or len(before) != len(table):
        raise ReplayMismatch(
            f"{len(table)} parameters, {len(before)} steps before and {len(after)} after"
        )
    stepped: Dict[int, Dict[int, list]] = {}
    for (offset, numel, inner, group), old, new in zip(table, before, after):
        if new == old:
            continue  # no step for this parameter (skipped, or no gradient)
        if new != old + 1:
            raise ReplayMismatch(f"a parameter's step went from {old} to {new}")
        where = slice(offset, offset + numel)
        param = views[0][where]
        param.grad = grads[where]
        stepped.setdefault(inner, {}).setdefault(group, []).append((param, where, old))
    for inner, groups in stepped.items():
        hyper, cls = extras["groups"][inner], optimizer_classes[inner]
        per_parameter = steps_per_parameter(cls)
        optimizer = cls(
            [
                dict(hyper[g], params=[p for p, _, _ in entries])
                # FusedAdam's step is its group's: the group steps together
                | ({} if per_parameter else {"step": int(entries[0][2])})
                for g, entries in groups.items()
            ]
        )
        for g, entries in groups.items():
            # fused and capturable kernels keep the step on the device
            on_device = hyper[g].get("fused") or hyper[g].get("capturable")
            for param, where, old in entries:
                state = {"exp_avg": views[1][where], "exp_avg_sq": views[2][where]}
                if per_parameter:
                    step = torch.tensor(old, dtype=torch.float32)
                    state["step"] = step.to(param.device) if on_device else step
                optimizer.state[param] = state
        optimizer.step()
        for entries in groups.values():
            for param, _, _ in entries:
                param.grad = None


def optimizer_classes(optimizer) -> List[type]:
    """The class of each inner optimizer (equal on every DP peer)."""
    return [type(opt.optimizer) for opt in inner_optimizers(optimizer)]


def extras_for(table: List[List[int]], groups: Optional[List[List[dict]]]) -> dict:
    return {"segments": table, "groups": groups or []}
