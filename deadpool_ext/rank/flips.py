"""``--deadpool-inject flip:...``: one bit of one element flips in this
rank's memory, where the target lies (inject.py's table). The element, and
the bit unless the spec names it, are drawn from the spec's seed, the rank
and the iteration, so a campaign can replay any flip."""

import random
from typing import List, Optional, Tuple

import torch

from megatron.training.training import Trainer

from deadpool_ext.inject import Fault
from deadpool_ext.rank.sdc import ddp_buffers
from deadpool_ext.state import snapshot as snap
from deadpool_ext.state.mirror import Mirror

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def candidates(
    fault: Fault, trainer: Trainer, mirror: Optional[Mirror]
) -> List[Tuple[str, torch.Tensor]]:
    """(name, flat tensor) of every place the target names on this rank."""
    model = trainer.state.model
    if fault.target == "param":
        return [(f"parameter buffer {i}", b.param_data) for i, b in enumerate(ddp_buffers(model))]
    if fault.target == "grad":
        return [(f"gradient buffer {i}", b.grad_data) for i, b in enumerate(ddp_buffers(model))]
    if fault.target == "optimizer":
        found = []
        for i, segment in enumerate(snap.build_layout(trainer.state.optimizer).segments):
            main, state = snap.main_param_and_state(trainer.state.optimizer, segment)
            found.append((f"segment {i} main parameter", main.detach().view(-1)))
            found += [(f"segment {i} {k}", v.view(-1)) for k, v in state.items() if k != "step"]
        return found
    if mirror is None or mirror.held_index is None:
        return []
    held = snap.regions(mirror.held[mirror.held_index], mirror.layout)
    return [(f"held replica's {name}", held[i]) for i, name in enumerate(snap.STATES)]


def flip(fault: Fault, trainer: Trainer, mirror: Optional[Mirror], iteration: int) -> dict:
    """Flip the drawn bit; what flipped where, for the event log."""
    places = [(n, t) for n, t in candidates(fault, trainer, mirror) if t.numel()]
    if not places:
        return {"flipped": None, "why": f"no {fault.target} on this rank now"}
    draw = random.Random(f"{fault.seed}:{fault.rank}:{iteration}:{fault.target}")
    total = sum(t.numel() for _, t in places)
    index = draw.randrange(total)
    for name, tensor in places:
        if index < tensor.numel():
            break
        index -= tensor.numel()
    width = tensor.element_size() * 8
    bit = (fault.bit if fault.bit is not None else draw.randrange(width)) % width
    before = tensor[index].item()
    flip_bit(tensor, index, bit)
    return {
        "flipped": name,
        "element": index,
        "bit": bit,
        "before": before,
        "after": tensor[index].item(),
    }


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """XOR one bit of element ``index`` of a flat tensor, in place."""
    words = tensor.view(_INTS[tensor.element_size()])
    mask = torch.ones((), dtype=words.dtype) << bit  # the sign bit wraps to the type's minimum
    with torch.no_grad():
        words[index] ^= mask
