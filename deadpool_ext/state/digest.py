"""Digests of tensors, and the error a disagreement between copies raises.

A digest is 64 bits over a tensor's bytes: xxHash's XXH3 on the host (one
read of memory, the hash snapshots are sealed with), a position-weighted
word sum on a device (computed where the tensor lies: copying parameters to
the host every iteration would cost more than the check; a device snapshot's
checksum is the same sum over chunks). Digests travel and are stored as
signed 64-bit words (``signed64``), and are shown unsigned (``unsigned64``).
"""

from typing import List, Optional

import torch
import xxhash


class SilentCorruption(RuntimeError):
    """Two copies that must be equal are not: a parameter differs between
    data-parallel replicas, or the buddy's replay of a step disagrees with
    its owner's result. ``iteration`` is the 1-based iteration whose result
    is in doubt; ``suspects`` the ranks that may hold the corrupted copy."""

    def __init__(self, check: str, iteration: int, suspects: List[int], detail: str):
        self.check, self.iteration, self.suspects = check, iteration, list(suspects)
        who = ", ".join(map(str, self.suspects)) or "unknown"
        super().__init__(
            f"silent data corruption ({check}) in iteration {iteration}, suspect rank(s) {who}: "
            f"{detail}"
        )


def unsigned64(value: int) -> int:
    return value % (1 << 64)


def signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def weighted_word_sum(words: torch.Tensor, chunk_words: int = 1) -> int:
    """Position-weighted sum of 64-bit words modulo 2**64: the words are
    summed per chunk of ``chunk_words``, and chunk i has the odd weight
    2i+3 (a word of the first chunk counts 3x)."""
    chunks = words.view(-1, chunk_words).sum(dim=1)
    weights = torch.arange(1, chunks.numel() + 1, dtype=torch.int64, device=words.device)
    return unsigned64(int((chunks * (2 * weights + 1)).sum().item()))


def tensor_digest(tensor: torch.Tensor) -> int:
    """64 bits over the tensor's bytes (contiguous ones; any dtype)."""
    data = tensor.detach().reshape(-1).view(torch.uint8)
    if data.device.type == "cpu":
        return xxhash.xxh3_64_intdigest(data.numpy())
    pad = (-data.numel()) % 8
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    return weighted_word_sum(data.view(torch.int64))


def odd_ones_out(digests: List[int]) -> Optional[List[int]]:
    """Indices whose digest differs from the majority's; every index when
    there is no majority (two replicas, or all differ); None when all agree."""
    if len(set(digests)) <= 1:
        return None
    counts = {d: digests.count(d) for d in set(digests)}
    top = max(counts.values())
    if top * 2 <= len(digests) or list(counts.values()).count(top) > 1:
        return list(range(len(digests)))
    majority = next(d for d, c in counts.items() if c == top)
    return [i for i, d in enumerate(digests) if d != majority]
