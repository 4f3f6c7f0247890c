"""``Policy.decide`` on the generations the coordinator hands it, built by
hand: a swap while spares last, a wait for spares still starting and its
bound, a shrink, a checkpoint or an abort when they run out (and the job
that cannot resize), a drain to spares or by a shrink or refused, a stop at
the boundary, the wait after a takeover until the live nodes beat, the
majority a decision needs beside a standby, and what a decision says of
the spares' GPUs. The rank arithmetic of each part is
tests/unit_tests/test_policy.py's and test_shrink.py's."""

from deadpool_ext.policy.decide import Policy
from deadpool_ext.policy.effects import Wait
from deadpool_ext.policy.view import Limits, Sighting
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
