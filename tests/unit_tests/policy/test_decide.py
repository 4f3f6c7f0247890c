"""``Policy.decide`` and its parts (deadpool_ext/policy/decide.py) on
generations built by hand: a swap while spares last, a wait for spares
still starting and its bound, a shrink, a checkpoint or an abort when they
run out (and the job that cannot resize), a drain to spares or by a shrink
or refused, a stop at the boundary, the wait after a takeover until the
live nodes beat, the majority a decision needs beside a standby, and what a
decision says of the spares' GPUs. Then the rank arithmetic of each part:
the hot swap's rollback point and spare placement, the groups a swap keeps,
the failures that must stop the job, and the shrink's and the grow's plans
(whole replicas, expert-parallel blocks, sizes the schedule runs at). The
real shrinks and grows are in tests/functional_tests/test_shrink.py."""

import dataclasses

import pytest

from deadpool_ext.policy.decide import (
    Policy,
    choose_spares,
    grow,
    kept_groups,
    kept_replicas,
    newest_common,
    renumber,
    replicas_to_add,
    shrink,
    swap,
    whole_replica,
)
from deadpool_ext.policy.effects import Wait
from deadpool_ext.policy.view import JobView, Limits, Sighting
from deadpool_ext.protocol import CoordinatorSettings, Decision, JobState, Report, Source, group_key
from deadpool_ext.topology import Grid
from tests.unit_tests.policy.job import (
    JOB,
    SHRINKING,
    S,
    lost_nodes,
    recovering,
    replace,
    reports,
)


def exhausted(view, on_spares_exhausted: str, **limits):
    """``view`` under another --deadpool-on-spares-exhausted."""
    settings = replace(view.settings, on_spares_exhausted=on_spares_exhausted)
    return replace(view, settings=settings, limits=Limits(on_spares_exhausted, **limits))


def test_spares_exhausted_ends_the_job_with_the_reason():
    failed = recovering(lost_nodes(JOB, 1), {1, 2, 3}, reports=reports([0]))
    decision = Policy().decide(failed)
    assert decision.action == "abort" and "rank 1 and its buddy rank 3" in decision.reason


def test_a_job_that_cannot_resize_ends_with_the_reason_when_spares_run_out():
    """An MoE job's plan says it cannot shrink: losing a node with no spare
    ends it (instead of a shrink its ranks could not carry out)."""
    moe = exhausted(SHRINKING, "shrink", cannot_resize="expert shards are not re-cut yet")
    decision = Policy().decide(recovering(moe, {2, 3}, reports=reports([0, 1])))
    assert decision.action == "abort"
    assert "cannot shrink (expert shards are not re-cut yet)" in decision.reason


def test_the_checkpoint_policy_gathers_the_shards_of_a_shrink_and_saves_them():
    """--deadpool-on-spares-exhausted checkpoint: the shrink's decision
    under another action."""
    saving = exhausted(SHRINKING, "checkpoint")
    decision = Policy().decide(recovering(saving, {3}, reports=reports([0, 1, 2])))
    assert decision.action == "checkpoint" and (decision.old_dp, decision.new_dp) == (2, 1)
    assert "saved iteration 5 and stopped" in decision.reason


# ----- spares still starting -----
# PP2 x DP2 on two nodes and a spare node whose two workers are still
# starting (--deadpool-spare-wait 30); rank 3 lost, the others reported.
WARMING = recovering(
    replace(
        SHRINKING,
        nodes=(0, 1, 2),
        alive_nodes=frozenset({0, 1, 2}),
        quorum_nodes=frozenset({0, 1, 2}),
        settings=replace(SHRINKING.settings, spare_wait=30.0),
        warming=("2.0", "2.1"),
        since_opened_s=1.0,
    ),
    {3},
    reports=reports([0, 1, 2]),
)


def test_a_recovery_waits_for_warming_spares_and_swaps_once():
    assert isinstance(Policy().decide(WARMING), Wait)
    ready = replace(WARMING, spares=("2.1",), warming=("2.0",))
    decision = Policy().decide(ready)
    assert decision.action == "recover" and decision.replaced == {3: "2.1"}


def test_the_wait_for_warming_spares_is_bounded():
    late = replace(WARMING, since_opened_s=31.0)
    assert Policy().decide(late).action == "shrink"


def test_no_wait_without_warming_spares():
    assert Policy().decide(replace(WARMING, warming=())).action == "shrink"


# ----- planned: a drain and a stop -----
def draining(view, *nodes):
    """Every rank reported at the boundary for a drain of ``nodes``."""
    return replace(view, gen=1, state=S.DRAINING, leaving=nodes, reports=reports(range(4)))


def test_a_drain_hands_node_1_to_the_spare_node_at_the_boundary():
    decision = Policy().decide(draining(JOB, 1))
    assert decision.action == "recover" and decision.rollback_to == 5 and decision.drained == [1]
    assert decision.replaced == {2: "2.0", 3: "2.1"} and decision.from_buddy == [2, 3]
    assert decision.released == ["1.0", "1.1"] and decision.reason == "node(s) [1] drained"


def test_a_drain_without_a_spare_shrinks():
    no_spare = exhausted(replace(JOB, spares=()), "shrink")
    decision = Policy().decide(draining(no_spare, 1))
    assert decision.action == "shrink" and decision.drained == [1]
    assert (decision.old_dp, decision.new_dp) == (4, 2)
    assert sorted(decision.released) == ["1.0", "1.1"]


def test_a_drain_nothing_can_carry_out_is_refused_and_the_job_goes_on():
    decision = Policy().decide(draining(replace(JOB, spares=()), 1))
    assert decision.action == "recover" and decision.drained == [] and decision.replaced == {}
    assert "not drained" in decision.warnings[0] and "abort" in decision.warnings[0]


def test_a_stop_saves_the_boundarys_state():
    asked = replace(draining(JOB), stop_request="the allocation ends")
    decision = Policy().decide(asked)
    assert decision.stop and decision.rollback_to == 5 and decision.replaced == {}
    assert decision.reason == "the allocation ends"


def test_a_stop_interrupted_by_a_failure_recovers_first_and_stops_after():
    asked = "stopped by deadpool-ctl"
    failed = recovering(JOB, {3}, gen=2, stop_request=asked, reports=reports([0, 1, 2]))
    swap = Policy().decide(failed)
    assert not swap.stop and swap.replaced == {3: "2.0"}
    members = swap.members
    after = replace(draining(JOB), gen=3, members=members, spares=("2.1",), stop_request=asked)
    after = replace(after, reports=reports(range(4), members=members))
    assert Policy().decide(after).stop


# ----- a takeover, and the majority beside a standby -----
def test_the_coordinator_that_took_over_decides_once_the_live_nodes_beat_on_its_store():
    """No agent has beaten there yet, so no spare is known to be warming: a
    decision now would shrink."""
    successor = recovering(
        exhausted(lost_nodes(JOB, 0), "shrink"),
        {0, 1},
        reports=reports([2, 3], held=[4]),
        settling_s=0.0,
    )
    assert Policy().decide(successor) == Wait(
        "waiting for every live node's agent to beat on this store"
    )
    beating = replace(successor, last_sighting=Sighting(beating=frozenset({1, 2})))
    decision = Policy().decide(beating)
    assert decision.action == "recover" and decision.replaced == {0: "2.0", 1: "2.1"}
    assert decision.from_buddy == [0, 1] and decision.rollback_to == 4


def test_a_primary_that_hears_from_no_majority_stops_instead_of_deciding():
    """Nodes 1 and 2 silent at once (a partition): the other side may take
    over, so this side must not go on (it would shrink to node 0). Without
    a standby (no quorum rule) the same losses shrink the job."""
    partitioned = recovering(
        exhausted(lost_nodes(JOB, 1, 2), "shrink"), {2, 3}, reports=reports([0, 1], held=[4])
    )
    guarded = Policy().decide(replace(partitioned, guards_quorum=True))
    assert guarded.action == "abort"
    assert "only nodes [0] of [0, 1, 2] are alive" in guarded.reason
    assert Policy().decide(partitioned).action == "shrink"


# ----- the spares' GPUs -----
def test_a_decision_names_the_gpu_it_takes_and_the_spare_it_left_out():
    """Spare 2.0's GPU has uncorrectable ECC errors: it is withheld."""
    healthy = "GPU 1 (GPU, memory unknown, 0 ECC): healthy"
    failed = recovering(
        replace(JOB, spares=("2.1",), withheld=("2.0",), gpus={"2.1": healthy}),
        {3},
        reports=reports([0, 1, 2]),
    )
    decision = Policy().decide(failed)
    assert decision.replaced == {3: "2.1"} and decision.withheld == ["2.0"]
    assert decision.gpus == {"2.1": healthy}


# ----- the hot swap's rank arithmetic -----
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


def swap_reports(own, held, skip=()):
    return {r: Report(r, MEMBERS[r], own[r], held[r]) for r in MEMBERS if r not in skip}


def test_a_lost_rank_is_replaced_and_everyone_restarts_the_interrupted_iteration():
    got = decide(
        {3},
        swap_reports(
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
        {3},
        swap_reports(
            {0: [6, 5], 1: [5, 4], 2: [5, 4]}, {0: [6, 5], 1: [5, 4], 2: [5, 4]}, skip={3}
        ),
    )
    assert got.rollback_to == 5


def test_a_buddy_that_only_holds_the_iteration_before_sets_the_rollback():
    got = decide(
        {3},
        swap_reports(
            {0: [5, 4], 1: [5, 4], 2: [5, 4]}, {0: [5, 4], 1: [4, 3], 2: [5, 4]}, skip={3}
        ),
    )
    assert got.rollback_to == 4


def test_no_common_iteration_stops_the_job():
    got = decide(
        {3},
        swap_reports(
            {0: [7, 6], 1: [5, 4], 2: [7, 6]}, {0: [7, 6], 1: [5, 4], 2: [7, 6]}, skip={3}
        ),
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
    survivors = swap_reports({0: [5], 1: [5], 2: [5]}, {0: [5], 1: [5], 2: [5]}, skip={3})
    for rank in (0, 1):
        survivors[rank].groups = {group_key((0, 1), 0): 7}
    got = decide({3}, survivors)
    assert got.kept == ["0,1#0"]
    assert Decision.from_message(got.to_message()) == got


# ----- groups a hot swap keeps (--deadpool-rebuild-groups changed) -----
def groups_report(rank, groups):
    return Report(rank, MEMBERS[rank], [5], [5], groups=groups)


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


# ----- a shrink and a grow: whole replicas -----
def limits(unit=1, sizes=None, **rest) -> Limits:
    return Limits(shrink_unit=unit, data_parallel_sizes=sizes and tuple(sizes), **rest)


def plan_shrink(gen, members, lost, reports, buddy, grid, unit=1, sizes=None, stop=False):
    """The policy's shrink of a job of ``grid`` that lost ``lost``."""
    view = JobView(
        gen=gen,
        members=members,
        lost=frozenset(lost),
        reports=reports,
        spares=(),
        buddy=tuple(buddy),
        owner=None,
        grid=grid,
        limits=limits(unit, sizes),
    )
    return shrink(view, stop=stop)


def plan_grow(gen, members, reports, spares, grid, planned_dp, sizes=None):
    """The policy's grow of a job of ``grid`` with ``spares`` ready."""
    view = JobView(
        gen=gen,
        members=members,
        lost=frozenset(),
        reports=reports,
        spares=tuple(spares),
        buddy=None,
        owner=None,
        grid=grid,
        planned_dp=planned_dp,
        limits=limits(sizes=sizes),
    )
    return grow(view)


def resize_reports(ranks, own=(2, 3), held=(2, 3)):
    return {r: Report(r, f"s{r}", list(own), list(held)) for r in ranks}


def test_an_moe_job_drops_whole_expert_parallel_blocks():
    """PP2 x DP4 with EP 2 in Megatron's default order: replicas 0, 1 and
    2, 3 each hold the 4 experts once. Losing rank 2 (replica 2) drops
    replicas 2 and 3; every kept rank keeps its expert-parallel rank (its
    new replica index modulo 2 is its old one), and none is made up."""
    grid = Grid(tp=1, pp=2, dp=4)  # rank = dp + 4 * pp
    kept = kept_replicas(grid, {2}, unit=2)
    assert kept == [whole_replica(grid, 0), whole_replica(grid, 1)]
    members = {r: f"{r // 2}.{r % 2}" for r in range(8)}
    buddy = [2, 3, 0, 1, 6, 7, 4, 5]  # shift 2: the same experts, another node
    d = plan_shrink(1, members, {2, 3}, resize_reports([0, 1, 4, 5, 6, 7]), buddy, grid, unit=2)
    assert (d.old_dp, d.new_dp) == (4, 2)
    assert d.renumber == {0: 0, 1: 1, 4: 2, 5: 3}
    assert all(old % 2 == new % 2 for old, new in d.renumber.items())  # EP rank kept
    assert d.sources[2] == [0, "held"] and d.sources[6] == [4, "held"]
    assert sorted(d.released) == ["3.0", "3.1"]
    # Control: replica by replica, the survivors of replicas 2 and 3 would be
    # assembled into a replica that mixes expert-parallel ranks.
    assert len(kept_replicas(grid, {2, 7})) == 3


def test_renumber_keeps_positions_and_order():
    grid = Grid(tp=1, pp=2, dp=4, tp_pp_dp=True)  # rank = pp + 2 * dp
    kept = [whole_replica(grid, d) for d in (0, 1, 3)]
    assert renumber(grid, kept) == {0: 0, 1: 1, 2: 2, 3: 3, 6: 4, 7: 5}
    grid = Grid(tp=2, pp=2, dp=3)  # rank = tp + 2 * (dp + 3 * pp)
    mapping = renumber(grid, [whole_replica(grid, 0), whole_replica(grid, 2)])
    new = grid.with_dp(2)
    for old, new_rank in mapping.items():
        tp, dp, pp = grid.coords(old)
        assert new.coords(new_rank) == (tp, [0, 2].index(dp), pp)


def test_kept_replicas_are_the_intact_ones_then_those_survivors_make_up():
    grid = Grid(tp=1, pp=4, dp=2, tp_pp_dp=True)  # rank = pp + 4 * dp
    # One loss: the other replica goes on alone, as always.
    assert kept_replicas(grid, {2}) == [whole_replica(grid, 1)]
    # A loss in each replica, at different stages: one replica of survivors.
    assert kept_replicas(grid, {2, 4}) == [{(0, 0): 0, (0, 1): 1, (0, 2): 6, (0, 3): 3}]
    # The same stage lost in both: nothing can be made up.
    assert kept_replicas(grid, {2, 6}) == []
    grid = Grid(tp=1, pp=2, dp=4, tp_pp_dp=True)  # rank = pp + 2 * dp
    assert kept_replicas(grid, {1, 2, 5}) == [whole_replica(grid, 3), {(0, 0): 0, (0, 1): 3}]


def test_plan_shrink_drops_the_broken_replica_and_names_sources():
    grid = Grid(tp=1, pp=2, dp=4, tp_pp_dp=True)
    members = {r: f"{r // 4}.{r % 4}" for r in range(8)}
    buddy = [(r + 4) % 8 for r in range(8)]  # replica d -> replica d+2
    live = [r for r in range(8) if r != 5]
    d = plan_shrink(1, members, {5}, resize_reports(live), buddy, grid)
    assert d.action == "shrink" and (d.old_dp, d.new_dp) == (4, 3)
    assert d.members == {0: "0.0", 1: "0.1", 2: "0.2", 3: "0.3", 4: "1.2", 5: "1.3"}
    assert d.released == ["1.0"]
    assert d.sources[5] == [1, "held"] and d.sources[4] == [0, "held"]
    assert d.sources[6] == [6, "own"] and d.rollback_to == 3


def test_an_interleaved_job_shrinks_to_a_size_its_schedule_runs_at():
    """PP2 x DP4 on the interleaved schedule, 8 microbatches per iteration:
    it runs at DP 1, 2 and 4 (shares of 8, 4, 2: multiples of PP 2), not at
    3 (shares 3, 3, 2). Losing rank 5 (replica 2) leaves replicas 0, 1, 3,
    and one more leaves: the last whose shards stay held by a kept rank."""
    grid = Grid(tp=1, pp=2, dp=4, tp_pp_dp=True)  # rank = pp + 2 * dp
    members = {r: f"{r // 4}.{r % 4}" for r in range(8)}
    live = [r for r in range(8) if r != 5]
    buddy = [(r + 4) % 8 for r in range(8)]  # replica d <-> replica d+2
    d = plan_shrink(1, members, {5}, resize_reports(live), buddy, grid, sizes=[1, 2, 4])
    assert d.action == "shrink" and (d.old_dp, d.new_dp) == (4, 2)
    assert d.renumber == {0: 0, 1: 1, 2: 2, 3: 3}  # replica 3 leaves: replica 1 holds it
    assert d.sources[5] == [1, "held"] and d.sources[6] == [2, "held"]
    assert sorted(d.released) == ["1.0", "1.2", "1.3"]
    assert "1 more left for a size the interleaved schedule runs at" in d.warnings[0]
    # A ring (replica d's shards on replica d+1): replica 3 holds the lost
    # shards and replica 1 relies on replica 2, so replica 0 leaves.
    ring = [(r + 2) % 8 for r in range(8)]
    d = plan_shrink(1, members, {5}, resize_reports(live), ring, grid, sizes=[1, 2, 4])
    assert (d.new_dp, d.renumber) == (2, {2: 0, 3: 1, 6: 2, 7: 3})
    assert d.sources[5] == [7, "held"] and d.sources[0] == [2, "held"]
    # Control: without the schedule's sizes the job goes on at DP 3.
    assert plan_shrink(1, members, {5}, resize_reports(live), buddy, grid).new_dp == 3
    # No size fits: the job stops with the reason.
    d = plan_shrink(1, members, {5}, resize_reports(live), buddy, grid, sizes=[4])
    assert d.action == "abort" and "data-parallel sizes [4] only" in d.reason


def test_an_interleaved_job_grows_only_to_a_size_its_schedule_runs_at():
    grid = Grid(tp=1, pp=2, dp=2)
    spares = [f"2.{i}" for i in range(4)]  # enough for DP 4
    assert replicas_to_add(grid, 4, spares) == 2
    assert replicas_to_add(grid, 4, spares, sizes=[1, 2, 4]) == 2
    assert replicas_to_add(grid, 4, spares[:2], sizes=[1, 2, 4]) == 0  # DP 3 does not run
    assert replicas_to_add(grid, 4, spares[:2]) == 1


def test_plan_shrink_refuses_when_no_replica_or_no_copy_is_left():
    grid = Grid(tp=1, pp=1, dp=2)
    members = {0: "0.0", 1: "1.0"}
    d = plan_shrink(1, members, {0, 1}, {}, [1, 0], grid)
    assert d.action == "abort" and "no complete data-parallel replica" in d.reason


def test_plan_shrink_makes_a_replica_of_the_survivors_of_two_broken_ones():
    """TP1 x PP4 x DP2: stage 2 of replica 0 and stage 0 of replica 1 are
    lost (a rank and a stuck survivor killed after it); stages 0, 1 and 3 of
    replica 0 and stage 2 of replica 1 train on, each lost shard coming from
    its buddy, every dropped survivor's from its buddy too."""
    grid = Grid(tp=1, pp=4, dp=2, tp_pp_dp=True)
    members = {r: f"{r // 4}.{r % 4}" for r in range(8)}
    buddy = [(r + 4) % 8 for r in range(8)]
    live = [r for r in range(8) if r not in (2, 4)]
    d = plan_shrink(2, members, {2, 4}, resize_reports(live), buddy, grid)
    assert d.action == "shrink" and (d.old_dp, d.new_dp) == (2, 1)
    assert d.renumber == {0: 0, 1: 1, 6: 2, 3: 3}
    assert d.members == {0: "0.0", 1: "0.1", 2: "1.2", 3: "0.3"}
    assert d.released == ["1.1", "1.3"]
    assert d.sources == {
        0: [0, "own"],
        1: [1, "own"],
        2: [6, "held"],
        3: [3, "own"],
        4: [0, "held"],
        5: [1, "held"],
        6: [6, "own"],
        7: [3, "held"],
    }
    assert "1 made up of their surviving ranks" in d.warnings[0]
    grid = Grid(tp=1, pp=1, dp=3)
    members = {r: f"{r}.0" for r in range(3)}
    # rank 1's copy is on rank 2, whose replica also broke
    d = plan_shrink(1, members, {1, 2}, resize_reports([0]), [1, 2, 0], grid)
    assert d.action == "abort" and "rank 1's optimizer shard has no copy" in d.reason
    d = plan_shrink(1, members, {1}, resize_reports([0, 2], own=(4,), held=(3,)), [1, 2, 0], grid)
    assert d.action == "abort" and "no iteration" in d.reason


def test_plan_grow_appends_whole_replicas_from_spares_in_node_order():
    grid = Grid(tp=2, pp=2, dp=1)  # rank = tp + 2 * (dp + 1 * pp)
    members = {0: "0.0", 1: "0.1", 2: "0.2", 3: "0.3"}
    spares = ["2.1", "1.0", "2.0", "1.3", "1.1", "1.2", "2.2"]  # 7: one replica of 4
    d = plan_grow(5, members, resize_reports(range(4), own=(7, 6)), spares, grid, planned_dp=4)
    assert d.action == "grow" and (d.old_dp, d.new_dp) == (1, 2) and d.rollback_to == 7
    new = grid.with_dp(2)  # rank = tp + 2 * (dp + 2 * pp)
    assert d.renumber == {0: 0, 1: 1, 2: 4, 3: 5}
    # The new replica's TP pairs are consecutive slots of node 1.
    assert d.replaced == {
        new.rank(0, 1, 0): "1.0",
        new.rank(1, 1, 0): "1.1",
        new.rank(0, 1, 1): "1.2",
        new.rank(1, 1, 1): "1.3",
    }
    assert d.world_size == 8 and set(d.members.values()) == set(members.values()) | {
        "1.0",
        "1.1",
        "1.2",
        "1.3",
    }
    assert all(d.sources[r] == [r, "own"] for r in range(4))


def test_plan_grow_stops_at_the_launched_size_and_needs_a_common_snapshot():
    grid = Grid(tp=1, pp=1, dp=2)
    members = {0: "0.0", 1: "0.1"}
    d = plan_grow(3, members, resize_reports([0, 1]), ["1.0", "1.1", "1.2"], grid, planned_dp=3)
    assert d.new_dp == 3 and d.replaced == {2: "1.0"}
    d = plan_grow(3, members, resize_reports([0, 1]), [], grid, planned_dp=3)
    assert d.action == "recover" and d.members == members and d.rollback_to == 3
    lagging = {0: Report(0, "0.0", [5], []), 1: Report(1, "0.1", [4], [])}
    d = plan_grow(3, members, lagging, ["1.0"], grid, planned_dp=3)
    assert d.action == "abort" and "no snapshot iteration" in d.reason
