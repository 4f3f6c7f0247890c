"""The coordinator's decision as pure rank arithmetic: rollback point,
spare placement, and the failures that must stop the job."""

import dataclasses

import pytest

from deadpool_ext.policy.decide import Policy, choose_spares, kept_groups, newest_common, swap
from deadpool_ext.policy.effects import Wait
from deadpool_ext.policy.view import JobView, Limits
from deadpool_ext.protocol import (
    CoordinatorSettings,
    Decision,
    JobState,
    Report,
    Source,
    group_key,
    group_members,
)
from deadpool_ext.topology import Grid

# 4 ranks on 2 nodes of 2 (TP2 x DP2, tp-pp-dp order): DP peers 0<->2, 1<->3.
MEMBERS = {0: "0.0", 1: "0.1", 2: "1.0", 3: "1.1"}
BUDDY = OWNER = [2, 3, 0, 1]
SPARES = ["2.0", "2.1"]


BEFORE = JobView(
    gen=1,
    members=MEMBERS,
    lost=frozenset(),
    reports={},
    spares=tuple(SPARES),
    buddy=tuple(BUDDY),
    owner=tuple(OWNER),
    grid=None,
)


def decide(lost, reports, **changes):
    """The hot swap's decision when ``lost`` died and the rest reported."""
    return swap(dataclasses.replace(BEFORE, lost=frozenset(lost), reports=reports, **changes))


def reports(own, held, skip=()):
    return {r: Report(r, MEMBERS[r], own[r], held[r]) for r in MEMBERS if r not in skip}


def test_a_lost_rank_is_replaced_and_everyone_restarts_the_interrupted_iteration():
    got = decide(
        {3},
        reports(
            {0: [5, 4], 1: [5, 4], 2: [5, 4], 3: []},
            {0: [5, 4], 1: [5, 4], 2: [5, 4], 3: []},
            skip={3},
        ),
    )
    assert got.action == "recover" and got.rollback_to == 5
    assert got.replaced == {3: "2.0"} and got.members[3] == "2.0"
    assert got.from_buddy == [3]


def test_survivors_one_step_apart_agree_on_the_older_snapshot():
    # Rank 0 finished step 5 (own 6, 5); the others did not (own 5, 4).
    got = decide(
        {3}, reports({0: [6, 5], 1: [5, 4], 2: [5, 4]}, {0: [6, 5], 1: [5, 4], 2: [5, 4]}, skip={3})
    )
    assert got.rollback_to == 5


def test_a_buddy_that_only_holds_the_iteration_before_sets_the_rollback():
    got = decide(
        {3}, reports({0: [5, 4], 1: [5, 4], 2: [5, 4]}, {0: [5, 4], 1: [4, 3], 2: [5, 4]}, skip={3})
    )
    assert got.rollback_to == 4


def test_no_common_iteration_stops_the_job():
    got = decide(
        {3}, reports({0: [7, 6], 1: [5, 4], 2: [7, 6]}, {0: [7, 6], 1: [5, 4], 2: [7, 6]}, skip={3})
    )
    assert got.action == "abort" and "no iteration" in got.reason


def test_rank_and_buddy_both_lost_stops_the_job():
    got = decide({1, 3}, {})
    assert got.action == "abort" and "rank 1 and its buddy rank 3 were both lost" in got.reason


def test_too_few_spares_stops_the_job():
    got = decide({0, 1}, {}, spares=("2.0",))
    assert got.action == "abort" and "spares exhausted" in got.reason


def test_a_spare_interrupted_mid_join_needs_its_buddy_again():
    members = {**MEMBERS, 3: "2.0"}
    got = decide(
        {0},
        {
            1: Report(1, "0.1", [5, 4], [5, 4]),
            2: Report(2, "1.0", [5, 4], [5, 4]),
            3: Report(3, "2.0", [], []),
        },
        gen=2,
        members=members,
        spares=("2.1",),
    )
    assert got.action == "recover" and got.from_buddy == [0, 3] and got.rollback_to == 5


def test_spares_avoid_the_node_of_buddy_and_owner_and_fill_one_node_first():
    members = {0: "0.0", 1: "0.1", 2: "1.0", 3: "1.1"}
    chosen, warnings = choose_spares([0, 1], ["3.1", "2.0", "3.0", "2.1"], members, BUDDY, OWNER)
    assert chosen == {0: "2.0", 1: "2.1"} and not warnings
    # Only a spare on the buddy's node is left: used, with a warning.
    chosen, warnings = choose_spares([0], ["1.5"], members, BUDDY, OWNER)
    assert chosen == {0: "1.5"} and warnings


def test_rollback_ignores_ranks_that_need_their_buddy():
    # Rank 0 needs its buddy (rank 2): its own snapshots do not count.
    got = newest_common(
        {0: [BUDDY[0], Source.HELD], 2: [2, Source.OWN]},
        {0: Report(0, "0.0", [5, 4], [5, 4]), 2: Report(2, "1.0", [5, 4], [4])},
    )
    assert got == 4


def test_decisions_survive_the_wire():
    survivors = reports({0: [5], 1: [5], 2: [5]}, {0: [5], 1: [5], 2: [5]}, skip={3})
    for rank in (0, 1):
        survivors[rank].groups = {group_key((0, 1), 0): 7}
    got = decide({3}, survivors)
    assert got.kept == ["0,1#0"]
    assert Decision.from_message(got.to_message()) == got


# ----- groups a hot swap keeps (--deadpool-rebuild-groups changed) -----
def groups_report(rank, groups):
    return Report(rank, MEMBERS[rank], [5], [5], groups=groups)


def test_a_group_key_names_its_members_and_its_place_among_their_groups():
    assert group_key((0, 2), 1) == "0,2#1"
    assert group_members(group_key((0, 2, 3), 0)) == [0, 2, 3]


def test_a_group_is_kept_where_every_member_reported_the_same_count():
    tp, dp = group_key((0, 1), 0), group_key((0, 2), 0)
    got = kept_groups(
        {
            0: groups_report(0, {tp: 4, dp: 9}),
            1: groups_report(1, {tp: 4}),
            2: groups_report(2, {}),
        },
        changed={3},
    )
    # {0, 2}: rank 2 did not report it (released, or it holds no such group).
    assert got == [tp]


def test_a_member_one_operation_ahead_makes_the_group_new():
    tp = group_key((0, 1), 0)
    reports_ = {0: groups_report(0, {tp: 5}), 1: groups_report(1, {tp: 4})}
    assert kept_groups(reports_, changed=set()) == []


def test_a_group_with_a_member_restored_from_its_buddy_is_made_again():
    # Rank 1's process is new (a spare of an interrupted recovery): even if it
    # reported the key, the group is not the one its peers hold.
    tp = group_key((0, 1), 0)
    reports_ = {0: groups_report(0, {tp: 5}), 1: groups_report(1, {tp: 5})}
    assert kept_groups(reports_, changed={1}) == []
    assert kept_groups(reports_, changed={3}) == [tp]


def test_missing_reports_are_a_caller_error():
    with pytest.raises(ValueError):
        decide({3}, {})


# ----- the policy: its parts composed (what the coordinator asks) -----
GRID = Grid(tp=2, pp=1, dp=2, tp_pp_dp=True)  # replicas {0, 1} and {2, 3}
SURVIVORS = {r: Report(r, MEMBERS[r], [5, 4], [5, 4]) for r in (0, 1, 2)}
FAILED = dataclasses.replace(
    BEFORE, lost=frozenset({3}), reports=SURVIVORS, grid=GRID, planned_dp=2
)


def policy_of(view, on_exhausted="abort", **limits):
    return Policy().choose(
        dataclasses.replace(view, limits=Limits(on_spares_exhausted=on_exhausted, **limits))
    )


@pytest.mark.parametrize("on_exhausted", ["abort", "shrink", "checkpoint"])
def test_a_spare_takes_the_lost_ranks_place_whatever_comes_after_the_spares(on_exhausted):
    got = policy_of(FAILED, on_exhausted)
    assert got.action == "recover" and got.replaced == {3: "2.0"} and got.rollback_to == 5


def test_without_spares_the_job_shrinks_saves_or_stops_as_asked():
    none_left = dataclasses.replace(FAILED, spares=())
    assert "spares exhausted" in policy_of(none_left, "abort").reason
    shrunk = policy_of(none_left, "shrink")
    assert shrunk.action == "shrink" and shrunk.members == {0: "0.0", 1: "0.1"}
    saved = policy_of(none_left, "checkpoint")
    # The checkpoint is decided as such (the shrink's gathering, then a stop),
    # not a shrink changed afterwards.
    assert saved.action == "checkpoint" and "saved iteration 5 and stopped" in saved.reason
    assert (saved.members, saved.sources) == (shrunk.members, shrunk.sources)
    cannot = policy_of(none_left, "shrink", cannot_resize="context parallelism")
    assert cannot.action == "abort" and "cannot shrink (context parallelism)" in cannot.reason


def test_warming_spares_are_waited_for_up_to_the_spare_wait():
    warming = dataclasses.replace(
        FAILED, spares=(), warming=("2.0",), settings=CoordinatorSettings(spare_wait=30.0)
    )
    assert isinstance(policy_of(warming, "shrink"), Wait)
    late = dataclasses.replace(warming, since_opened_s=30.0)
    assert policy_of(late, "shrink").action == "shrink"
    # Too few are starting to make up the loss: no wait.
    short = dataclasses.replace(warming, lost=frozenset({1, 3}), warming=("2.0",))
    assert not isinstance(policy_of(short, "shrink"), Wait)


def test_a_doomed_generation_stops_at_once_and_a_grow_generation_grows():
    doomed = dataclasses.replace(FAILED, doomed="a second NaN", spares=(), warming=("2.0", "2.1"))
    assert policy_of(doomed, "shrink").reason == "a second NaN"
    shrunk = dataclasses.replace(
        BEFORE,
        members={0: "0.0", 1: "0.1"},
        reports={r: SURVIVORS[r] for r in (0, 1)},
        grid=GRID.with_dp(1),
        planned_dp=2,
        state=JobState.GROWING,
    )
    got = policy_of(shrunk)
    assert got.action == "grow" and got.replaced == {2: "2.0", 3: "2.1"}
