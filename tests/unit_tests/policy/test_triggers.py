"""The coordinator's ordered rules (policy/triggers.py), each judged on a
view built by hand: which exit, silence, stall or fault is a loss and whom
the agents kill, which generation a loss, a NaN, a corruption, a drain, a
stop or a grow opens, which spares it names, when the job stops and why,
and when a generation's progress moves the job on. A loss a trigger finds
comes back into ``lost_ranks`` through the view's news, as the coordinator
hands it on; where the generation that follows is decided, ``Policy.decide``
is asked as the coordinator asks it. What goes out (the keys published, the
commands sent) is tests/unit_tests/control/test_coordinator.py's."""

import pytest

from deadpool_ext.defaults import STUCK_KILL_TIMEOUTS
from deadpool_ext.policy import triggers as T
from deadpool_ext.policy.decide import Policy
from deadpool_ext.policy.effects import (
    Admission,
    Advance,
    Caught,
    DropDrain,
    Judged,
    Loss,
    Lost,
    Note,
    Opening,
    QueueDrain,
    Redone,
    Rollback,
    SendOff,
    Stop,
    Wait,
)
from deadpool_ext.policy.exits import only_copies
from deadpool_ext.policy.states import AT_BOUNDARY
from deadpool_ext.policy.stragglers import node_times
from deadpool_ext.policy.view import AgentEnded, Exited, Progress, Sighting, TookOver
from deadpool_ext.protocol import Decision, ExitCode, NodeUp, NumericFault, WorkerState
from deadpool_ext.topology import Grid
from tests.unit_tests.policy.job import (
    JOB,
    MEMBERS,
    SHRINKING,
    S,
    every_trigger,
    losses,
    lost_nodes,
    plan,
    recovering,
    replace,
    reports,
    with_news,
)

TRAINING, RECOVERING = WorkerState.TRAINING, WorkerState.RECOVERING


def exited(slot: str, code: int, reason=None) -> Exited:
    """An agent saw ``slot``'s process end (a member's, not released)."""
    return Exited(slot, code, reason, JOB.rank_of(slot), released=False)


def judged_losses(view, effects):
    """``lost_ranks`` on the losses a trigger found."""
    return T.lost_ranks(with_news(view, *losses(effects)))


def opening_of(effects) -> Opening:
    (opening,) = [e for e in effects if isinstance(e, Opening)]
    return opening


def opens_or_stops(effects) -> bool:
    """Whether a generation opens or the job ends."""
    return any(isinstance(e, (Opening, Stop)) for e in effects)


def notes(effects, event: str):
    return [e for e in effects if isinstance(e, Note) and e.event == event]


# ----- exits -----
def test_an_exit_is_a_loss_whose_generation_names_the_likely_spare():
    found = T.exits(with_news(JOB, exited("1.1", -9)))
    assert found == (Loss(("1.1",), "process exited with code -9"),)
    lost = judged_losses(JOB, found)
    opening = opening_of(lost)
    assert lost[0] == Lost(("1.1",))
    assert (opening.state, opening.cause, opening.lost) == (S.RECOVERING, "failure", (3,))
    # The likely spare is named at once, so it builds while survivors report.
    assert opening.assign == {3: "2.0"} and opening.leaving == ()
    decided = Policy().decide(recovering(JOB, {3}, reports=reports([0, 1, 2])))
    assert decided.action == "recover" and decided.replaced == {3: "2.0"}
    assert decided.rollback_to == 5
    rebuilding = replace(JOB, gen=1, state=S.REBUILDING, resumed=frozenset(range(4)))
    assert T.resumed(rebuilding) == (Advance(S.TRAINING, recovered=True),)


def test_a_rank_stopped_by_a_bug_stops_the_job_and_a_local_failure_is_replaced():
    """A spare would meet the same bug: no recovery. A device failure is the
    rank's own: it is lost and swapped like a killed one."""
    found = T.exits(with_news(JOB, exited("1.1", int(ExitCode.LOCAL_FAILURE))))
    lost = judged_losses(JOB, found)
    assert opening_of(lost).state == S.RECOVERING and opening_of(lost).lost == (3,)
    assert not [e for e in lost if isinstance(e, Stop)]
    after = recovering(JOB, {3})
    (stop,) = T.exits(with_news(after, exited("0.1", int(ExitCode.BUG))))
    assert isinstance(stop, Stop)
    assert "programming error" in stop.reason and "0.1" in stop.reason


def test_a_slot_declared_lost_ends_as_it_may_and_the_job_goes_on():
    """A node cut off by the network was declared lost and swapped; healed,
    its worker meets a decision with no place for it and exits (a bug, as
    it happens, or fenced) before its agent knows: nothing of the job
    follows from it. The same exit from a slot not lost stops the job."""
    swapped = replace(JOB, members={0: "0.0", 1: "0.1", 2: "2.0", 3: "1.1"})
    lost = replace(swapped, lost_slots=frozenset({"1.0"}))
    for code in (ExitCode.BUG, ExitCode.USAGE, ExitCode.FENCED, -9):
        assert T.exits(with_news(lost, exited("1.0", int(code)))) == ()
    (stop,) = T.exits(with_news(swapped, exited("1.0", int(ExitCode.BUG))))
    assert isinstance(stop, Stop) and "programming error" in stop.reason


def test_refused_flags_stop_the_job_with_the_workers_words():
    """Every process runs the same flags: no spare is tried."""
    found = T.exits(with_news(JOB, exited("1.1", int(ExitCode.USAGE), "no -x")))
    assert found == (Stop("slot 1.1 (rank 3) refused its flags: no -x"),)


def test_a_failure_during_recovery_moves_to_the_next_generation():
    """Rank 0 dies before reporting: no decision for generation 1; the
    next one swaps both lost ranks."""
    first = recovering(JOB, {3}, reports=reports([1, 2]))
    assert isinstance(Policy().decide(first), Wait)
    lost = judged_losses(first, T.exits(with_news(first, exited("0.0", -9))))
    opening = opening_of(lost)
    assert opening.state == S.RECOVERING and opening.lost == (0,)
    second = recovering(first, {0, 3}, gen=2, reports=reports([1, 2]))
    decision = Policy().decide(second)
    assert decision.action == "recover" and decision.replaced == {0: "2.0", 3: "2.1"}


# ----- what ended or fell silent -----
def test_a_silent_worker_on_a_beating_node_is_killed_and_lost():
    look = Sighting(hung_slots=("1.0",))
    found = T.hung_workers(replace(JOB, sighting=look))
    assert found == (Loss(("1.0",), "no heartbeat for 3.0 s (hung)", kill=("1.0",)),)
    assert opening_of(judged_losses(JOB, found)).lost == (2,)


def test_a_silent_node_is_one_failure_in_one_generation():
    found = T.silent_nodes(replace(JOB, sighting=Sighting(silent_nodes=(1,))))
    assert found == (Loss(("1.0", "1.1"), "node 1 lost: no heartbeat for 3.0 s", kill_nodes=(1,)),)
    assert opening_of(judged_losses(JOB, found)).lost == (2, 3)  # one generation for both


def test_a_node_whose_ranks_finished_is_no_loss_when_its_agent_ends_or_it_falls_silent():
    """At the job's end a node's agent ends once its workers have, and a
    node whose ranks finished stops beating, while others may still save."""
    finished = replace(JOB, done=frozenset({2, 3}))
    assert T.agents_ended(with_news(finished, AgentEnded(1, 0))) == ()
    silent = replace(finished, sighting=Sighting(silent_nodes=(1,)))
    assert T.silent_nodes(silent) == () and T.lost_ranks(silent) == ()


def test_a_rank_lost_after_others_finished_stops_the_job_with_the_reason():
    """The control of the test above: one of node 1's ranks said it is done,
    the other did not. The finished ones have left, so no generation could
    gather them again: the job stops."""
    half = replace(JOB, done=frozenset({2}))
    found = T.agents_ended(with_news(half, AgentEnded(1, 0)))
    assert found == (
        Loss(("1.0", "1.1"), "node 1 lost: agent exited with code 0", kill_nodes=(1,)),
    )
    stop = judged_losses(half, found)[-1]
    assert isinstance(stop, Stop)
    assert "after ranks [2] had finished" in stop.reason and "ranks [3]" in stop.reason


@pytest.mark.parametrize("nproc, world_size", [(2, 6), (4, 8), (2, None)])
def test_a_launcher_started_with_other_sizes_stops_the_job_at_once(nproc, world_size):
    """Its workers would wait for a world that never forms (10 minutes)."""
    same = NodeUp(node=1, active=True, nproc=2, world_size=4)
    assert T.launchers(with_news(JOB, same)) == ()
    other = NodeUp(node=1, active=True, nproc=nproc, world_size=world_size)
    (stop,) = T.launchers(with_news(JOB, other))
    assert isinstance(stop, Stop) and "same --nnodes, --nproc-per-node" in stop.reason


def test_a_join_into_a_live_node_is_refused_and_one_into_a_free_index_admitted():
    def joins(node, nproc, nonce):
        up = NodeUp(node=node, active=False, nproc=nproc, join=True, nonce=nonce)
        return T.launchers(with_news(SHRINKING, up))

    assert joins(1, 2, "a1") == (Admission(1, "a1", "node 1 is still part of the job"),)
    (other_size,) = joins(5, 3, "b2")
    assert other_size.refused is not None
    assert joins(5, 2, "c3") == (Admission(5, "c3", None),)


# ----- the members that neither report nor stop -----
def test_a_survivor_still_training_after_the_announcement_is_killed_and_swapped():
    """Rank 0 keeps beating "training" after rank 3's loss was announced
    (blocked where no release reaches); rank 1 is slow but recovering.
    At STUCK_KILL_TIMEOUTS heartbeat timeouts rank 0 alone is killed, and the
    next generation swaps both lost ranks from their buddies."""
    states = {"0.0": TRAINING, "0.1": RECOVERING, "1.0": RECOVERING}
    bound = STUCK_KILL_TIMEOUTS * JOB.settings.heartbeat_timeout
    waiting = recovering(JOB, {3}, reports=reports([2]), sighting=Sighting(states=states))
    inside = replace(waiting, since_opened_s=bound - 1.0)
    assert not losses(every_trigger(inside)) and not opens_or_stops(every_trigger(inside))
    found = T.stuck_members(replace(waiting, since_opened_s=bound + 0.5))
    (loss,) = found
    assert loss.slots == loss.kill == ("0.0",) and loss.kill_nodes == ()
    assert opening_of(judged_losses(waiting, found)).lost == (0,)
    second = recovering(waiting, {0, 3}, gen=2, reports=reports([1, 2]))
    decision = Policy().decide(second)
    assert decision.action == "recover" and sorted(decision.from_buddy) == [0, 3]


def test_a_stuck_survivor_holding_the_only_copy_of_a_shard_is_waited_for():
    """Rank 1 is stuck after rank 3's loss, but rank 1 holds the only copy
    of rank 3's shard (BUDDY: 3 -> 1): killing it would lose state, so the
    coordinator waits for the groups' timeout to free it (plus two heartbeat
    timeouts), and kills it only then."""
    states = {"0.1": TRAINING, "0.0": RECOVERING, "1.0": RECOVERING}
    waiting = recovering(
        JOB, {3}, reports=reports([0, 2]), sighting=Sighting(states=states), group_timeout_s=180.0
    )
    assert only_copies(waiting.members, set(waiting.lost), waiting.buddy) == {
        1: "holds the only copy of lost rank 3's optimizer shard"
    }
    for since in (179.0, 186.0):  # within 180 + 2 * 3 s
        inside = replace(waiting, since_opened_s=since)
        assert not losses(every_trigger(inside)) and not opens_or_stops(every_trigger(inside))
        assert notes(T.stuck_members(inside), "stuck_waited")
    found = every_trigger(replace(waiting, since_opened_s=187.0))
    assert losses(found) == (Loss(("0.1",), "did not report within 186 s", kill=("0.1",)),)
    assert opening_of(judged_losses(waiting, found)).lost == (1,)


def test_a_rank_computing_without_progress_while_peers_wait_is_killed():
    """Rank 1's main thread is stuck computing in iteration 4 (a driver call,
    its heartbeat thread beats on); the others wait on it in communication.
    After --deadpool-progress-timeout it is killed and swapped; a slow
    iteration whose peers do not wait, or a checkpoint, is not. Its beats
    reach its progress as the detector hands them on, one look a second."""
    training = replace(
        JOB,
        settings=replace(JOB.settings, progress_timeout=10.0),
        sighting=Sighting(states={slot: TRAINING for slot in MEMBERS.values()}),
    )
    threads = {slot: Progress() for slot in MEMBERS.values()}
    clock = [100.0]

    def second(where_of) -> tuple:
        for rank, slot in MEMBERS.items():
            threads[slot].observe({"iteration": 4, "where": where_of(rank)}, clock[0])
        found = T.computing_without_progress(replace(training, main_threads=threads, now=clock[0]))
        clock[0] += 1.0
        return found

    # Everyone computes a long iteration: nobody waits.
    assert not any(second(lambda rank: "compute") for _ in range(12))
    # A checkpoint that takes long: not a hang either.
    assert not any(
        second(lambda rank: "checkpoint" if rank == 1 else "communication") for _ in range(12)
    )
    for seconds in range(12):
        found = second(lambda rank: "compute" if rank == 1 else "communication")
        if found:
            break
    (loss,) = found
    assert seconds == 10 and loss.slots == loss.kill == ("0.1",)
    assert opening_of(judged_losses(training, found)).lost == (1,)


# ----- a loss no decision can combine with what is under way -----
RESIZED = {0: "0.0", 1: "0.1"}  # SHRINKING after replica 1 left


def test_a_loss_while_resizing_ends_the_job():
    resizing = replace(SHRINKING, gen=1, members=RESIZED, state=S.RESIZING)
    stop = T.lost_ranks(with_news(resizing, Loss(("0.1",), "process exited with code -9")))[-1]
    assert isinstance(stop, Stop) and "while the job was being resized" in stop.reason


def test_a_loss_while_saving_the_checkpoint_ends_the_job():
    checkpoint = Decision(gen=1, action="checkpoint", members=RESIZED)
    saving = replace(SHRINKING, gen=1, members=RESIZED, state=S.STOPPING, stopping=checkpoint)
    stop = T.lost_ranks(with_news(saving, Loss(("0.0",), "process exited with code -9")))[-1]
    assert isinstance(stop, Stop) and "while the job was saving its checkpoint" in stop.reason


def test_a_checkpoint_decided_stops_once_resumed_and_ready_spares_never_grow_it():
    checkpoint = Decision(gen=1, action="checkpoint", members=RESIZED)
    resizing = replace(
        SHRINKING,
        gen=1,
        members=RESIZED,
        state=S.RESIZING,
        stopping=checkpoint,
        resumed=frozenset({0, 1}),
    )
    assert T.resumed(resizing) == (Advance(S.STOPPING, recovered=True),)
    # The dropped replica's slots come back as spares meanwhile.
    saving = replace(resizing, state=S.STOPPING, spares=("1.0", "1.1"), resumed=frozenset())
    assert not opens_or_stops(every_trigger(saving))


# ----- a NaN and a corruption -----
def fault(gen, rank, iteration, error, **corruption) -> NumericFault:
    return NumericFault(
        gen=gen, rank=rank, slot=MEMBERS[rank], iteration=iteration, error=error, **corruption
    )


def test_a_nan_rolls_every_rank_back_once_and_a_second_one_stops_the_job():
    """--deadpool-on-nan rollback: nobody is lost, every rank reports and
    restores its own snapshot of the iteration's start; a clean redo is a
    transient fault (said once); NaN again in that iteration stops the job,
    once every rank has reported (to hear why it stops)."""
    found = T.nans(with_news(JOB, fault(0, 1, 4, "found NaN")))
    opening = opening_of(found)
    assert Rollback(4, 1) in found and notes(found, "nan_detected")
    assert opening.state == S.RECOVERING and opening.lost == () and opening.doomed is None
    rolled = replace(JOB, gen=1, state=S.RECOVERING, reports=reports(range(4)))
    decision = Policy().decide(rolled)
    assert decision.action == "recover" and decision.replaced == {} and decision.rollback_to == 5
    redone = replace(JOB, gen=1, progress={r: 4 for r in range(4)}, rolled_back={4}, redoing={4: 1})
    said = T.clean_redos(redone)
    assert said[0] == Redone(4, 1) and len(notes(said, "nan_transient")) == 1
    again = replace(redone, redoing={})
    found = T.nans(with_news(again, fault(1, 2, 4, "found Inf")))
    assert not [e for e in found if isinstance(e, Stop)]
    doomed = opening_of(found).doomed
    assert "again in iteration 4" in doomed
    ending = replace(again, gen=2, state=S.RECOVERING, doomed=doomed, reports=reports(range(4)))
    decision = Policy().decide(ending)
    assert decision.action == "abort" and "again in iteration 4" in decision.reason


def test_a_corruption_is_redone_and_the_same_suspect_caught_again_is_swapped():
    """--deadpool-on-sdc rollback: the first catch rolls every rank back
    (nobody lost); the suspect caught again is killed and replaced."""
    corruption = dict(check="mirror-replay", suspects=[1])
    found = T.corruptions(with_news(JOB, fault(0, 1, 4, "digests differ", **corruption)))
    opening = opening_of(found)
    assert Caught((1,), 4) in found and opening.state == S.RECOVERING and opening.lost == ()
    rolled = replace(JOB, gen=1, state=S.RECOVERING, reports=reports(range(4)))
    decision = Policy().decide(rolled)
    assert decision.action == "recover" and decision.replaced == {}
    again = replace(JOB, gen=1, caught={(1,): 4})
    found = T.corruptions(with_news(again, fault(1, 1, 6, "digests differ", **corruption)))
    assert Caught((1,), 6, forgive=1) in found
    (loss,) = losses(found)
    assert loss.slots == loss.kill == ("0.1",)
    assert opening_of(judged_losses(again, found)).lost == (1,)


# ----- planned: a drain, a stop, a grow -----
def test_a_drain_hands_the_nodes_ranks_to_ready_spares_at_the_boundary():
    asked = replace(JOB, drains={1: "maintenance"})
    opening = opening_of(T.drains_due(asked))
    assert (opening.state, opening.cause, opening.leaving) == (S.DRAINING, "drain", (1,))
    assert opening.state in AT_BOUNDARY and opening.lost == ()
    # They build while the ranks reach the boundary.
    assert opening.assign == {2: "2.0", 3: "2.1"}


def test_a_drained_nodes_release_is_no_failure_and_it_may_join_again():
    drained = lost_nodes(replace(JOB, drained_nodes=frozenset({1})), 1)
    release = exited("1.0", int(ExitCode.RELEASED))
    assert T.exits(with_news(drained, release)) == ()
    up = NodeUp(node=1, active=False, nproc=2, join=True, nonce="j")
    assert T.launchers(with_news(drained, up)) == (Admission(1, "j", None),)


def test_a_drain_waits_for_warming_spares_while_training_goes_on():
    waiting = replace(
        JOB,
        spares=(),
        warming=("2.0", "2.1"),
        settings=replace(JOB.settings, spare_wait=30.0),
        drains={1: "asked by deadpool-ctl"},
    )
    (said,) = T.drains_due(waiting)
    assert said.event == "drain_waits_for_spares" and said.once
    opening = opening_of(T.drains_due(replace(waiting, spares=("2.0", "2.1"), warming=())))
    assert opening.state == S.DRAINING and opening.assign == {2: "2.0", 3: "2.1"}


def test_a_node_without_a_rank_leaves_at_once_and_one_lost_first_is_not_drained():
    idle = replace(JOB, drains={2: "asked by deadpool-ctl"})
    assert T.drains_of_idle_nodes(idle) == (SendOff(2, "asked by deadpool-ctl"),)
    lost_first = lost_nodes(replace(JOB, drains={1: "asked by deadpool-ctl"}), 1)
    assert T.drains_of_lost_nodes(lost_first) == (
        DropDrain(1, "the node was lost before it could be drained"),
    )
    assert T.drains_of_idle_nodes(lost_first) == ()


def test_a_stop_saves_at_the_boundary_and_the_job_ends_well():
    asked = replace(JOB, stop_request="the allocation ends")
    (opening,) = T.stop_requested(asked)
    assert (opening.state, opening.cause, opening.leaving) == (S.DRAINING, "stop", ())
    assert opening.state in AT_BOUNDARY
    stop = Decision(gen=1, action="recover", rollback_to=5, members=MEMBERS, stop=True)
    rebuilding = replace(
        asked, gen=1, state=S.REBUILDING, stopping=stop, resumed=frozenset(range(4))
    )
    assert T.resumed(rebuilding) == (Advance(S.STOPPING, recovered=True),)


def test_a_shrunk_job_grows_back_once_ready_spares_fill_a_replica():
    """Node 1 (replica 1) was lost and the job shrank to node 0; node 1
    joins again: one ready spare is no replica yet, two are."""
    shrunk = replace(
        lost_nodes(SHRINKING, 1),
        gen=1,
        members=RESIZED,
        grid=Grid(tp=1, pp=2, dp=1, tp_pp_dp=True),
        buddy=None,
        owner=None,
        plan=plan(pp=2, tp_pp_dp=True, buddy=None),
    )
    up = NodeUp(node=1, active=False, nproc=2, join=True, nonce="n1")
    assert T.launchers(with_news(shrunk, up)) == (Admission(1, "n1", None),)
    joined = replace(shrunk, lost_slots=frozenset(), alive_nodes=frozenset({0, 1}))
    assert T.grow(replace(joined, spares=("1.1",))) == ()
    (opening,) = T.grow(replace(joined, spares=("1.1", "1.0")))
    assert (opening.state, opening.cause) == (S.GROWING, "grow")
    assert opening.state in AT_BOUNDARY and notes(opening.notes, "grow_announced")
    growing = replace(
        joined, gen=2, state=S.GROWING, spares=("1.1", "1.0"), reports=reports([0, 1], own=(9, 8))
    )
    decision = Policy().decide(growing)
    assert decision.action == "grow" and decision.rollback_to == 9
    assert decision.members == {0: "0.0", 1: "0.1", 2: "1.0", 3: "1.1"}
    resized = replace(JOB, gen=2, state=S.RESIZING, resumed=frozenset(range(4)))
    assert T.resumed(resized) == (Advance(S.TRAINING, recovered=True),)


# ----- the straggler watch -----
def compute_beats(seconds: dict, count=2, iteration=9) -> dict:
    return {
        slot: {"seconds": s, "count": count, "iteration": iteration} for slot, s in seconds.items()
    }


def watching(compute: dict):
    settings = replace(JOB.settings, straggler_window=2, on_straggler="swap")
    window = settings.straggler_window
    return replace(
        JOB,
        settings=settings,
        sighting=Sighting(),
        node_times=node_times(compute, list(MEMBERS.values()), window),
    )


def test_a_straggler_is_reported_and_with_swap_drained_to_a_ready_spare_node():
    beats = compute_beats({"0.0": 0.10, "0.1": 0.11, "1.0": 0.19, "1.1": 0.23})
    # 0.21 is not twice 0.105 (the default factor).
    assert T.stragglers(watching(beats)) == (Judged({}, ()),)
    beats.update(compute_beats({"1.0": 0.31, "1.1": 0.35}))
    found = T.stragglers(watching(beats))
    judged = found[0]
    assert judged.drains_asked == (1,) and notes(found, "straggler")
    assert judged.stragglers[1].ratio == pytest.approx(0.33 / 0.105, rel=0.01)
    (drain,) = [e for e in found if isinstance(e, QueueDrain)]
    opening = opening_of(T.drains_due(replace(JOB, drains={drain.node: drain.reason})))
    assert opening.state == S.DRAINING and opening.leaving == (1,)


def test_a_straggler_is_asked_to_drain_once_while_it_stays_one():
    slow = watching(compute_beats({"0.0": 0.1, "0.1": 0.1, "1.0": 0.4, "1.1": 0.4}))
    found = T.stragglers(slow)
    reason = "straggler: 4.0x the other nodes' compute time"
    assert QueueDrain(1, reason, by="straggler watch") in found
    # As a drain the policy refused leaves it: not again while it stays slow.
    asked = replace(slow, stragglers=found[0].stragglers, straggler_drains=frozenset({1}))
    again = T.stragglers(asked)
    assert not [e for e in again if isinstance(e, QueueDrain)] and again[0].drains_asked == (1,)


# ----- a takeover -----
def test_the_coordinator_that_takes_over_loses_node_0_and_names_its_spares():
    gone = TookOver(0, "the coordinator's node went silent", node_alive=False)
    found = T.took_over(with_news(JOB, gone))
    assert found == (
        Loss(("0.0", "0.1"), "node 0 lost: the coordinator's node went silent", kill_nodes=(0,)),
    )
    opening = opening_of(judged_losses(JOB, found))
    assert opening.lost == (0, 1) and opening.assign == {0: "2.0", 1: "2.1"}


def test_when_only_the_coordinators_launcher_died_training_goes_on():
    """Node 0's agent came over: its ranks live. In training the successor
    keeps the generation (no rank redoes anything); in the middle of a
    recovery, whose reports went to the primary, everyone reports again."""
    alive = TookOver(0, "silent", node_alive=True)
    assert T.took_over(with_news(JOB, alive)) == ()
    (opening,) = T.took_over(with_news(recovering(JOB, {3}), alive))
    assert opening.state == S.RECOVERING and opening.lost == ()
    assert opening.reasons == ("silent: every rank reports again to the new coordinator",)
