"""Gradient replay (--deadpool-mirror-mode grad) without processes: an owner
steps torch's AdamW on its parameters; a buddy advances the owner's earlier
snapshot by the packet and must seal the owner's own snapshot bit for bit.
The multi-rank runs (test_mirror.py) check the same through megatron-core's
distributed optimizer."""

import pytest
import torch

from deadpool_ext.state import replay
from deadpool_ext.state import snapshot as snap

SIZES = [300, 17, 1000, 5]  # parameter tensors; the first two decay, the others not
OFFSETS = [0, 320, 352, 1376]  # as in buckets: gaps left between them
NUMEL = 1408


class GroupStepAdamW(torch.optim.Optimizer):
    """AdamW kept as Apex's and Transformer Engine's FusedAdam keep it (what
    megatron-core runs where either is installed): one step per parameter
    group, an int; the moments in each parameter's state."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            (b1, b2), t = group["betas"], group["step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1**t))


class Owner:
    """A shard of four main parameters in two parameter groups."""

    def __init__(self, adam=torch.optim.AdamW):
        generator = torch.Generator().manual_seed(0)
        self.params = [torch.randn(n, generator=generator) for n in SIZES]
        self.adam = adam(
            [
                {"params": self.params[:2], "weight_decay": 0.1},
                {"params": self.params[2:], "weight_decay": 0.0},
            ],
            lr=1e-3,
        )
        self.layout = snap.ShardLayout([], NUMEL, 64 * 1024)
        self.table = [[o, n, 0, 0 if i < 2 else 1] for i, (o, n) in enumerate(zip(OFFSETS, SIZES))]

    def step(self, t: int, skip=()):
        generator = torch.Generator().manual_seed(100 + t)
        for i, p in enumerate(self.params):
            p.grad = None if i in skip else torch.randn(p.shape, generator=generator)
        for group in self.adam.param_groups:
            group["lr"] = 1e-3 * (t + 1)  # a schedule: each step its own
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in self.adam.param_groups]]
        self.adam.step()
        return groups

    def snapshot(self, iteration: int) -> torch.Tensor:
        buffer = snap.allocate(self.layout)
        views, steps = snap.regions(buffer, self.layout), []
        for p, offset in zip(self.params, OFFSETS):
            where = slice(offset, offset + p.numel())
            views[0][where].copy_(p)
            state = self.adam.state[p]
            if state:
                views[1][where].copy_(state["exp_avg"])
                views[2][where].copy_(state["exp_avg_sq"])
                group = next(g for g in self.adam.param_groups if any(q is p for q in g["params"]))
                steps.append(float(state["step"] if "step" in state else group["step"]))
        side = snap.encode_sidecar({"steps": steps, "progress": {"iteration": iteration}})
        snap.seal(buffer, self.layout, iteration, 3, side)
        return buffer

    def packet(self, own: torch.Tensor, groups) -> torch.Tensor:
        packet = replay.allocate(self.layout)
        grads = replay.grad_region(packet, self.layout)
        for p, offset in zip(self.params, OFFSETS):
            if p.grad is not None:  # none: zeros, as the packet is allocated
                grads[offset : offset + p.numel()].copy_(p.grad)
        replay.seal_packet(packet, self.layout, own, replay.extras_for(self.table, groups))
        return packet


def advance(owner: Owner, replica: torch.Tensor, packet: torch.Tensor) -> torch.Tensor:
    target = snap.allocate(owner.layout)
    replay.apply(packet, replica, target, owner.layout, [type(owner.adam)], owner=3)
    return target


@pytest.mark.parametrize("adam", [torch.optim.AdamW, GroupStepAdamW], ids=["torch", "group-step"])
def test_the_replica_follows_its_owner_bit_for_bit_from_the_first_step(adam):
    owner = Owner(adam)
    replica = owner.snapshot(0)  # the whole snapshot, once
    for t in range(5):
        groups = owner.step(t)
        own = owner.snapshot(t + 1)
        replica = advance(owner, replica, owner.packet(own, groups))
        assert torch.equal(replica, own)
        assert snap.verify(replica, owner.layout, iteration=t + 1, owner=3) == t + 1


def test_a_parameter_without_a_gradient_is_left_as_adam_leaves_it():
    owner = Owner()
    groups = owner.step(0)
    replica = owner.snapshot(1)
    groups = owner.step(1, skip=(2,))  # no gradient: no step, no moment decay
    own = owner.snapshot(2)
    assert torch.equal(advance(owner, replica, owner.packet(own, groups)), own)


@pytest.mark.parametrize("corrupt", ["gradient", "learning rate", "replica"])
def test_any_difference_is_a_digest_mismatch(corrupt):
    owner = Owner()
    owner.step(0)
    replica = owner.snapshot(1)
    groups = owner.step(1)
    own = owner.snapshot(2)
    if corrupt == "learning rate":
        groups[0][1]["lr"] *= 1.0000001
    packet = owner.packet(own, groups)
    if corrupt == "gradient":
        replay.grad_region(packet, owner.layout).view(torch.int32)[400] ^= 1
    if corrupt == "replica":
        snap.regions(replica, owner.layout)[2].view(torch.int32)[7] ^= 1 << 20
    target = snap.allocate(owner.layout)
    with pytest.raises(replay.ReplayMismatch, match="digest"):
        replay.apply(packet, replica, target, owner.layout, [torch.optim.AdamW], owner=3)
    with pytest.raises(snap.SnapshotError):  # nothing half-made is taken for a snapshot
        snap.verify(target, owner.layout)


def test_a_step_count_that_jumps_is_refused():
    owner = Owner()
    owner.step(0)
    replica = owner.snapshot(1)
    owner.step(1)
    groups = owner.step(2)
    own = owner.snapshot(3)  # two steps after the replica's
    with pytest.raises(replay.ReplayMismatch, match="from 1.0 to 3.0"):
        advance(owner, replica, owner.packet(own, groups))


def test_a_parameter_group_entry_that_cannot_travel_is_refused():
    with pytest.raises(snap.SnapshotError, match="--deadpool-mirror-mode state"):
        replay._scalars({"params": [], "lr": torch.tensor(1e-3)})
