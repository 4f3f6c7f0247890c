"""The group-rebuild time model (tools/planning/rebuild_cost.py), in-process:
which groups a hot swap rebuilds and what a full and a partial rebuild pay.
The groups it is fed are checked in tests/functional_tests/test_rebuild_model.py."""

from tools.planning import rebuild_cost as rg

HELD = {"tp": [0, 1], "dp": [0, 2, 4, 6], "WORLD": list(range(8)), "alone": [0]}
COSTS = rg.GroupCosts(per_call=1.0, per_member=10.0)


def test_a_group_is_rebuilt_only_with_a_changed_member():
    assert rg.rebuilt_roles(HELD, {3}) == ["WORLD"]
    assert rg.rebuilt_roles(HELD, {1, 6}) == ["tp", "dp", "WORLD"]
    assert rg.rebuilt_roles(HELD, set()) == []


def test_full_rebuild_pays_every_call_and_its_own_groups_by_size():
    # 20 groups created, 4 held (2 + 4 + 8 + 1 members): 16 calls.
    assert rg.members(HELD) == 15
    assert rg.full_rebuild_s(HELD, 20, COSTS) == 16 * 1.0 + 15 * 10.0


def test_partial_rebuild_pays_only_the_groups_with_a_changed_member():
    assert rg.partial_rebuild_s(HELD, {3}, COSTS) == 8 * 10.0
    assert rg.partial_rebuild_s(HELD, set(), COSTS) == 0.0
    # A spare (every member changed for it) pays what a full rebuild pays
    # for its own groups, and none of the calls for others' groups.
    everything = set(range(8))
    assert rg.partial_rebuild_s(HELD, everything, COSTS) == rg.full_rebuild_s(HELD, 4, COSTS)
