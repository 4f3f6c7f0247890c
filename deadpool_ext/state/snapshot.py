"""A rank's distributed-optimizer shard as one flat, self-checking buffer.

Layout of a snapshot (bytes)::

    [header: 8 x int64][param | exp_avg | exp_avg_sq : 3 x N fp32][sidecar][zero pad]

N is the sum over the optimizer's buckets of ``bucket numel / DP``, with each
main parameter at its ``gbuf_local`` offset, so N (and the whole buffer) is the
same on every data-parallel rank of a (tp, pp) position: an exchange between
buddies is one send and one receive of equal size. The sidecar holds what exact
replay needs beside the shard (Adam's step per parameter, RNG states at
iteration start, scheduler, grad scaler, progress), serialized with
``torch.save`` and read back with ``weights_only=True``.

The checksum is xxHash's XXH3 (64 bits, the ``xxhash`` package) of the whole
buffer with the checksum's own slot read as zero: one read of memory (12 ms
on a 114 MB buffer here, where the position-weighted word sum it replaced
took 16 ms), and no structured corruption it is blind to (that sum missed
two words swapped within a 32 KiB chunk, +d/-d on two words of one chunk,
and an even number of flips of bit 63). A buffer in GPU memory
(--deadpool-mirror-memory device) keeps the weighted sum, computed where it
lies: copying it to the host to hash it would cost more than the mirror.
"""

import io
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import xxhash

from deadpool_ext.state.digest import signed64, unsigned64, weighted_word_sum

from megatron.training.optimizer_layout import (
    REGIONS,
    inner_optimizers,
    steps_per_parameter,
    walk_buckets,
)

MAGIC = 0x44504D4952524F52  # "DPMIRROR"
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8
CHUNK_WORDS = 4096  # checksum granularity: buffers are padded to whole chunks
STATES = REGIONS
# header slots
H_MAGIC, H_ITERATION, H_NUMEL, H_SIDECAR, H_CHECKSUM, H_OWNER = range(6)


class SnapshotError(RuntimeError):
    """A snapshot that cannot be used: torn, corrupted or from another layout."""


@dataclass
class Segment:
    """One main parameter's place in the flat shard."""

    optimizer_index: int  # which inner DistributedOptimizer
    model_param: torch.nn.Parameter
    offset: int  # first element in each state region
    numel: int


@dataclass
class ShardLayout:
    segments: List[Segment]
    numel: int  # N: elements per state region, equal on DP peers
    sidecar_capacity: int  # bytes reserved for the sidecar

    @property
    def nbytes(self) -> int:
        return whole_chunks(HEADER_BYTES + len(STATES) * self.numel * 4 + self.sidecar_capacity)


def whole_chunks(nbytes: int) -> int:
    """A buffer's size: whole checksum chunks (the device checksum sums them)."""
    chunk = CHUNK_WORDS * 8
    return -(-nbytes // chunk) * chunk


def build_layout(optimizer) -> ShardLayout:
    """Walk the distributed optimizers' buckets in their fixed order."""
    for opt in inner_optimizers(optimizer):
        if not hasattr(opt, "gbuf_ranges"):
            raise SnapshotError(
                "--deadpool needs megatron-core's DistributedOptimizer "
                "(--use-distributed-optimizer)"
            )
        if getattr(opt.config, "use_precision_aware_optimizer", False):
            raise SnapshotError("--deadpool does not support the precision-aware optimizer")
    segments, base, model_params = [], 0, 0
    for b in walk_buckets(optimizer):
        model_params += len(b.bucket.params)
        for model_param, ranges in b.param_map.items():
            local = ranges["gbuf_local"]
            segments.append(
                Segment(
                    b.optimizer_index,
                    model_param,
                    b.shard_start + local.start,
                    local.end - local.start,
                )
            )
        base = b.shard_start + b.bucket.grad_data.numel() // b.optimizer.data_parallel_group.size()
    segments.sort(key=lambda s: s.offset)
    # Adam's steps (one float per parameter) and RNG states; equal on DP peers.
    capacity = 256 * 1024 + 64 * model_params
    return ShardLayout(segments, base, capacity)


def main_param_and_state(optimizer, segment: Segment) -> Tuple[torch.Tensor, dict]:
    main, state, _, _ = _locate(optimizer, segment)
    return main, state


def _locate(optimizer, segment: Segment):
    """A segment's main parameter, its Adam state, its parameter group and
    whether its Adam keeps the step in the state (torch's) or the group."""
    opt = inner_optimizers(optimizer)[segment.optimizer_index]
    group, order = opt.model_param_group_index_map[segment.model_param]
    group = opt.optimizer.param_groups[group]
    main = group["params"][order]
    return main, opt.optimizer.state[main], group, steps_per_parameter(opt.optimizer)


def allocate(layout: ShardLayout, device="cpu", pin: bool = False) -> torch.Tensor:
    return zeros(layout.nbytes, device, pin)


def zeros(nbytes: int, device="cpu", pin: bool = False) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)


def sidecar_area(buffer: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The bytes reserved for the sidecar, after the state regions."""
    start = HEADER_BYTES + len(STATES) * layout.numel * 4
    return buffer[start : start + layout.sidecar_capacity]


def regions(buffer: torch.Tensor, layout: ShardLayout) -> List[torch.Tensor]:
    """fp32 views of the param, exp_avg and exp_avg_sq regions."""
    floats = buffer[HEADER_BYTES : HEADER_BYTES + len(STATES) * layout.numel * 4]
    floats = floats.view(torch.float32)
    return [floats[i * layout.numel : (i + 1) * layout.numel] for i in range(len(STATES))]


def header(buffer: torch.Tensor) -> torch.Tensor:
    return buffer[:HEADER_BYTES].view(torch.int64)


def pack_shard(optimizer, layout: ShardLayout, buffer: torch.Tensor) -> List[float]:
    """Copy the live shard into the buffer; returns Adam's step per segment
    (empty before the first step, when Adam has no state yet)."""
    views, steps = regions(buffer, layout), []
    for seg in layout.segments:
        main, state, group, per_parameter = _locate(optimizer, seg)
        end = seg.offset + seg.numel
        views[0][seg.offset : end].copy_(main.detach().view(-1), non_blocking=True)
        if "exp_avg" in state:
            views[1][seg.offset : end].copy_(state["exp_avg"].view(-1), non_blocking=True)
            views[2][seg.offset : end].copy_(state["exp_avg_sq"].view(-1), non_blocking=True)
            steps.append(float(state["step"] if per_parameter else group["step"]))
        else:  # no state yet: Adam's zeros, whatever the buffer held before
            views[1][seg.offset : end].zero_()
            views[2][seg.offset : end].zero_()
    return steps


def unpack_shard(optimizer, layout: ShardLayout, buffer: torch.Tensor, steps: List[float]) -> None:
    """Write a snapshot's shard into the live optimizer, creating Adam's
    state when the optimizer is fresh."""
    views = regions(buffer, layout)
    if steps and len(steps) != len(layout.segments):
        raise SnapshotError(
            f"snapshot has {len(steps)} Adam steps for "
            f"{len(layout.segments)} parameters: another layout"
        )
    for i, seg in enumerate(layout.segments):
        main, state, group, per_parameter = _locate(optimizer, seg)
        end = seg.offset + seg.numel
        main.data.view(-1).copy_(views[0][seg.offset : end])
        if not steps:  # a fresh optimizer's: no state, no step
            state.clear()
            if not per_parameter:
                group.pop("step", None)
            continue
        for name, view in zip(STATES[1:], views[1:]):
            source = view[seg.offset : end].view_as(main)
            if name in state:
                state[name].copy_(source)
            else:
                state[name] = source.to(main.device, copy=True)
        if per_parameter:
            state["step"] = torch.tensor(steps[i], dtype=torch.float32)
        else:  # every parameter of the group has stepped as often
            group["step"] = int(steps[i])


def encode_sidecar(sidecar: dict) -> bytes:
    stream = io.BytesIO()
    torch.save(sidecar, stream)
    return stream.getvalue()


def decode_sidecar(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def checksum(buffer: torch.Tensor) -> int:
    """The buffer's checksum with its own header slot read as zero (see the
    module doc): XXH3-64 on the host, the weighted word sum on a device."""
    if buffer.device.type != "cpu":  # the slot (weight 3) taken back out
        return unsigned64(_weighted_sum(buffer) - 3 * int(header(buffer)[H_CHECKSUM]))
    h = header(buffer).clone()
    h[H_CHECKSUM] = 0
    hasher = xxhash.xxh3_64()
    hasher.update(h.numpy().tobytes())
    hasher.update(buffer[HEADER_BYTES:].numpy())
    return hasher.intdigest()


def _weighted_sum(buffer: torch.Tensor) -> int:
    """The position-weighted sum over whole checksum chunks: a word of the
    header chunk counts 3x."""
    return weighted_word_sum(buffer.view(torch.int64), CHUNK_WORDS)


def seal(
    buffer: torch.Tensor, layout: ShardLayout, iteration: int, owner: int, sidecar: bytes
) -> None:
    """Write the sidecar and the header; the checksum goes in last."""
    if len(sidecar) > layout.sidecar_capacity:
        raise SnapshotError(
            f"sidecar of {len(sidecar)} bytes exceeds the reserved {layout.sidecar_capacity}"
        )
    side = sidecar_area(buffer, layout)
    if sidecar:
        side[: len(sidecar)].copy_(torch.frombuffer(bytearray(sidecar), dtype=torch.uint8))
    side[len(sidecar) :].zero_()
    h = header(buffer)
    h.zero_()
    h[H_MAGIC], h[H_ITERATION], h[H_NUMEL] = MAGIC, iteration, layout.numel
    h[H_SIDECAR], h[H_OWNER] = len(sidecar), owner
    h[H_CHECKSUM] = signed64(checksum(buffer))


def verify(
    buffer: torch.Tensor,
    layout: ShardLayout,
    iteration: Optional[int] = None,
    owner: Optional[int] = None,
) -> int:
    """Raise SnapshotError unless the buffer is a whole, uncorrupted snapshot
    (of the given iteration and owner); returns its iteration."""
    h = header(buffer).clone()
    if int(h[H_MAGIC]) != MAGIC:
        raise SnapshotError("not a snapshot (bad magic): torn or never written")
    if int(h[H_NUMEL]) != layout.numel:
        raise SnapshotError(
            f"snapshot holds {int(h[H_NUMEL])} elements per state, this layout {layout.numel}"
        )
    expected = unsigned64(int(h[H_CHECKSUM]))
    actual = checksum(buffer)
    if actual != expected:
        raise SnapshotError(
            f"checksum mismatch ({actual:#x} != {expected:#x}): the snapshot is corrupted"
        )
    if iteration is not None and int(h[H_ITERATION]) != iteration:
        raise SnapshotError(f"snapshot is of iteration {int(h[H_ITERATION])}, expected {iteration}")
    if owner is not None and int(h[H_OWNER]) != owner:
        raise SnapshotError(f"snapshot belongs to rank {int(h[H_OWNER])}, expected {owner}")
    return int(h[H_ITERATION])


def to_host(buffer: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """A copy in host memory of a snapshot verified where it lies, its
    checksum the host's kind (XXH3): a device snapshot carries the
    weighted sum, which a host copy would never verify against."""
    verify(buffer, layout)
    host = buffer.to("cpu", copy=True)
    header(host)[H_CHECKSUM] = signed64(checksum(host))
    return host


def snapshot_iteration(buffer: torch.Tensor) -> int:
    return int(header(buffer)[H_ITERATION])


def read_sidecar(buffer: torch.Tensor, layout: ShardLayout) -> dict:
    length = int(header(buffer)[H_SIDECAR])
    return decode_sidecar(sidecar_area(buffer, layout)[:length].cpu().numpy().tobytes())
