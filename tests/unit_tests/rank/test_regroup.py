"""Re-pointing process groups by identity, wherever objects hold them, in a
fake world in this process. Whether torch lets a gloo group outlive its default
group is probed in tests/functional_tests/test_regroup.py."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg as fake_pg

from deadpool_ext.rank import regroup


class Holder:
    __slots__ = ("group", "other")


def holders(group):
    slotted = Holder()
    slotted.group, slotted.other = group, 3

    def closure():
        return group

    class Plain:
        pass

    plain = Plain()
    plain.nested = {"list": [group, (1, group)], "fn": closure, "slotted": slotted}
    plain.bound = functools.partial(print)
    return plain, closure


def test_detach_then_attach_moves_every_reference_to_the_new_group(fake_world):
    root, closure = holders(dist.group.WORLD)
    slots = regroup.detach({"root": root})
    assert not dist.is_initialized()
    assert regroup.live_groups([root]) == 0
    assert isinstance(closure(), regroup.GroupSlot)
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=4)
    new = dist.group.WORLD
    assert regroup.attach({"root": root}, slots) == 4
    assert root.nested["list"][0] is new and root.nested["list"][1] == (1, new)
    assert root.nested["slotted"].group is new and closure() is new


def test_a_group_of_no_known_role_is_refused(fake_world):
    stranger = dist.new_group([0, 1])  # held by nobody megatron knows
    with pytest.raises(regroup.RegroupError, match="no known role"):
        regroup.swap_groups({"root": {"g": stranger}}, {}, (dist.ProcessGroup,))


def test_detach_fails_loudly_if_an_old_group_stays_referenced(fake_world):
    kept = [dist.group.WORLD]  # outside the roots: the walk cannot see it
    with pytest.raises(regroup.RegroupError, match="still referenced"):
        regroup.detach({"root": {}}, settle_s=0.2)
    del kept


class _Gather(torch.autograd.Function):
    """Holds its group in its context, as megatron-core's mappings do."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def test_groups_in_a_kept_autograd_graph_are_moved_too(fake_world):
    """A layer that keeps a tensor between calls (megatron-core's MoE token
    dispatchers, from dispatch to combine) keeps its autograd graph alive
    after a failure, and the graph's functions hold groups."""
    x = torch.ones(2, requires_grad=True)
    layer = {"probs": _Gather.apply(x, dist.group.WORLD) + 1}
    slots = regroup.detach({"layer": layer}, settle_s=0.5)
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=1, world_size=4)
    assert regroup.attach({"layer": layer}, slots) == 1
    assert layer["probs"].grad_fn.next_functions[0][0].group is dist.group.WORLD


def test_a_group_kept_out_of_reach_is_named_with_its_holder(fake_world):
    """The graph's contexts are dicts the collector does not track: the
    error still says who holds the group (control for the test above)."""
    x = torch.ones(2, requires_grad=True)
    hidden = [_Gather.apply(x, dist.group.WORLD)]  # outside the roots
    with pytest.raises(regroup.RegroupError, match="untracked dict in _GatherBackward"):
        regroup.detach({"root": {}}, settle_s=0.2)
    del hidden
