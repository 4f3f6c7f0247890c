"""Re-shard the distributed optimizer's state onto a different DP size,
between live ranks (a shrink or a grow). The arithmetic is in
``megatron.training.optimizer_layout``; a snapshot's regions are a DP
rank's flat shard in exactly that layout (``snapshot.build_layout``).

The exchange, per (tp, pp) position, over gloo (the snapshots live in host
memory, on GPU too): every old snapshot is broadcast, checksum verified,
from the rank that contributes it (``policy.shard_sources``; after a grow,
its owner) to the position's ranks that held state before (the groups are
the generation's: ``rank.generation.position_groups``). After a grow
the position's first rank then sends the whole re-laid state, sealed like a
snapshot, to every rank of the position, the new ones included.
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.training import optimizer_layout

from deadpool_ext.protocol import Decision, Source
from deadpool_ext.state import snapshot as snap
from deadpool_ext.state.mirror import Mirror


@dataclass(frozen=True)
class Holdings:
    """What a survivor brings of its (tp, pp) position's old state to a
    resize: the old world's shard layout, the position's ranks in it, the
    mirror whose snapshots this rank contributes, and the old optimizer's
    buckets, which the gathered shards are laid out in."""

    layout: snap.ShardLayout
    mirror: Optional[Mirror]
    ring: List[int]  # the position's old ranks, in DP order
    rank: int  # this process's old rank
    buckets: list  # optimizer_layout.buckets of the old model and optimizer
    experts: List[int]  # the ring's ranks holding this rank's experts (none: dense)


def gather_state(old: Holdings, decision: Decision, group) -> Tuple[dict, dict]:
    """The position's whole optimizer state in the old buckets, and this
    rank's sidecar, from every old snapshot of the rollback iteration
    (``gather_position`` over ``group``, the position's holders)."""
    buffers = gather_position(old, decision, group)
    shards = [snap.regions(b, old.layout) for b in buffers]
    experts = [shards[old.ring.index(r)] for r in old.experts]
    state = optimizer_layout.full_state(old.buckets, shards, experts)
    return state, snap.read_sidecar(buffers[old.ring.index(old.rank)], old.layout)


def share_position(
    layout: snap.ShardLayout,
    flats: Optional[torch.Tensor],
    sidecar: Optional[dict],
    iteration: int,
    root: int,
    group,
) -> Tuple[torch.Tensor, dict]:
    """The root's full state and sidecar on every rank of the position,
    sealed and verified like a snapshot. ``layout``: this rank's new shard
    layout (its sidecar room is the same on every rank of the position)."""
    whole = snap.ShardLayout(
        [], flats.shape[1] if flats is not None else 0, layout.sidecar_capacity
    )
    size = torch.tensor([whole.numel], dtype=torch.int64)
    dist.broadcast(size, root, group=group)
    whole.numel = int(size.item())
    buffer = snap.allocate(whole)
    if dist.get_rank() == root:
        for view, values in zip(snap.regions(buffer, whole), flats):
            view.copy_(values)
        # One Adam step for all: the receivers' segments differ from the root's.
        steps = sorted(set(sidecar["steps"]))[:1]
        snap.seal(buffer, whole, iteration, root, snap.encode_sidecar(dict(sidecar, steps=steps)))
    dist.broadcast(buffer, root, group=group)
    snap.verify(buffer, whole, iteration=iteration, owner=root)
    return torch.stack(snap.regions(buffer, whole)), snap.read_sidecar(buffer, whole)


def gather_position(old: Holdings, decision: Decision, group) -> List[torch.Tensor]:
    """Every old snapshot of this position, in old DP order, on every rank
    of ``group`` (the position's holders): broadcast by its contributor,
    verified on arrival."""
    own = contributions(old, decision)
    buffers = []
    for old_rank in old.ring:
        contributor = decision.renumber[decision.sources[old_rank][0]]
        buffer = own.get(old_rank)
        if buffer is None:
            buffer = snap.allocate(old.layout)
        else:  # device-memory mirrors too: resharding runs on the host
            try:
                buffer = snap.to_host(buffer, old.layout)
            except snap.SnapshotError:
                # Sent anyway, torn: every holder's verify below refuses it
                # together, none waits in the broadcast for this one.
                buffer = snap.allocate(old.layout)
        dist.broadcast(buffer, contributor, group=group)
        snap.verify(buffer, old.layout, iteration=decision.rollback_to, owner=old_rank)
        buffers.append(buffer)
    return buffers


def contributions(old: Holdings, decision: Decision) -> Dict[int, torch.Tensor]:
    """The old snapshots of the position that this rank broadcasts, by old rank."""
    mine = {}
    for old_rank in old.ring:
        contributor, kind = decision.sources[old_rank]
        if contributor == old.rank:
            buffers = old.mirror.own if kind == Source.OWN else old.mirror.held
            mine[old_rank] = buffers[old.mirror.find(kind, decision.rollback_to)]
    return mine


def build_snapshot(
    layout: snap.ShardLayout, regions: List[torch.Tensor], sidecar: dict, iteration: int, owner: int
) -> torch.Tensor:
    """A sealed snapshot of the new layout, ready for ``restore_snapshot``."""
    buffer = snap.allocate(layout)
    for view, values in zip(snap.regions(buffer, layout), regions):
        if values.numel() != view.numel():
            raise snap.SnapshotError(
                f"re-sharded state has {values.numel()} elements, the new layout {view.numel()}"
            )
        view.copy_(values)
    steps = sorted(set(sidecar["steps"]))
    if len(steps) > 1:
        raise snap.SnapshotError(f"Adam steps differ between parameters: {steps}")
    sidecar = dict(sidecar, steps=steps * len(layout.segments))
    snap.seal(buffer, layout, iteration, owner, snap.encode_sidecar(sidecar))
    return buffer
