"""policy/exits.py, policy/admission.py and control/membership.py: what an
exit or a stall means, who may join, and who is who, without a store or a
process."""

import dataclasses

from deadpool_ext import protocol as P
from deadpool_ext.control.membership import Membership
from deadpool_ext.control.record import JobRecord, Round, Watch, view_of
from deadpool_ext.policy import exits as watch
from deadpool_ext.policy.admission import why_not_join
from deadpool_ext.policy.view import Exited, Progress, Sighting
from deadpool_ext.protocol import CoordinatorSettings, ExitCode

MEMBERS = {0: "0.0", 1: "0.1", 2: "1.0", 3: "1.1"}
BUDDY = [2, 3, 0, 1]


def exited(code, reason=None) -> Exited:
    return Exited(slot="1.1", code=code, reason=reason, rank=3, released=False)


def test_exits_a_spare_would_repeat_stop_the_job_and_others_are_losses():
    assert "refused its flags: bad --lr" in watch.why_an_exit_stops_the_job(
        exited(ExitCode.USAGE, "bad --lr"), 3
    )
    assert "programming error" in watch.why_an_exit_stops_the_job(exited(ExitCode.BUG), 3)
    assert "NaN or Inf" in watch.why_an_exit_stops_the_job(exited(ExitCode.NUMERIC), 3)
    for code in (ExitCode.FAILED, ExitCode.LOCAL_FAILURE, -9):
        assert watch.why_an_exit_stops_the_job(exited(code), 3) is None
    assert watch.exit_as_loss(-9) == "process exited with code -9"
    assert watch.exit_as_loss(7) == "process exited with code 7 (LOCAL_FAILURE)"


def test_only_copies_names_the_buddy_of_a_lost_rank_and_the_rank_whose_buddy_was_lost():
    assert watch.only_copies(MEMBERS, {3}, BUDDY) == {
        1: "holds the only copy of lost rank 3's optimizer shard"
    }
    assert watch.only_copies(MEMBERS, {1, 3}, BUDDY) == {}  # both copies gone: nothing to keep
    assert watch.only_copies(MEMBERS, {3}, None) == {}  # no plan yet


def test_a_stuck_member_holding_the_only_copy_is_kept_and_said_why():
    states = {slot: P.WorkerState.TRAINING for slot in MEMBERS.values()}
    states["0.0"] = P.WorkerState.RECOVERING
    copies = watch.only_copies(MEMBERS, {3}, BUDDY)
    kill, kept = watch.stuck(MEMBERS, {3}, {2}, states, copies)
    assert kill == [] and kept == {1: copies[1]}
    kill, kept = watch.stuck(MEMBERS, {3}, set(), states, {})
    assert kill == [1, 2] and kept == {}


def progress(where, advanced_at, since) -> Progress:
    return Progress(iteration=5, advanced_at=advanced_at, where=where, where_since=since)


def test_a_member_computing_without_progress_is_hung_only_while_a_peer_waits_on_it():
    states = {slot: P.WorkerState.TRAINING for slot in MEMBERS.values()}
    seen = {
        "0.0": progress(P.Where.COMPUTE, 0.0, 0.0),
        "0.1": progress(P.Where.COMMUNICATION, 0.0, 0.0),
    }
    assert watch.hung_computing(MEMBERS, states, seen, 10.0, now=10.0) == ["0.0"]
    assert watch.hung_computing(MEMBERS, states, seen, 10.0, now=9.0) == []  # not yet
    seen["0.1"] = progress(P.Where.COMPUTE, 0.0, 0.0)  # nobody waits: slow, not hung
    assert watch.hung_computing(MEMBERS, states, seen, 10.0, now=60.0) == []
    assert watch.hung_computing(MEMBERS, states, seen, 0.0, now=60.0) == []  # check off


def test_membership_round_trips_and_admits_a_node_only_where_one_is_free():
    view = Membership.launched(nnodes=2, spare_nodes=1, nproc=2)
    assert view.members == MEMBERS and view.planned_size == 4 and view.nodes() == [0, 1, 2]
    assert view.lose(["1.1", "2.0"]) == {3} and view.alive_nodes() == {0, 1, 2}
    record = dataclasses.replace(
        JobRecord.launched(CoordinatorSettings(), 2, 1, 2), membership=view
    )
    assert JobRecord.from_json(record.to_json()).membership == view
    seen = view_of(record, Round(), Watch(), (None, Sighting(), {}, {}), (), 0.0)
    assert why_not_join(seen, 1, 2) == "node 1 is still part of the job"
    assert why_not_join(seen, 3, 4) == "it runs 4 ranks per node, the job 2"
    assert why_not_join(seen, 3, 2) is None and view.admit(3) == ["3.0", "3.1"]
    assert view.nodes() == [0, 1, 2, 3]
    view.released.add("0.1")
    assert view.note_exit("0.1") and "0.1" not in view.released  # a shrink's: no loss
    assert not view.note_exit("1.0")
