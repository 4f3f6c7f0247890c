"""What an exit or a stall means (deadpool_ext/policy/exits.py), without a
store or a process: which exits stop the job and which are losses, who
holds the only copy of a lost rank's shard, whom a stall kills and who is
kept, and when a member computing without progress is hung."""

from deadpool_ext import protocol as P
from deadpool_ext.policy import exits as watch
from deadpool_ext.policy.view import Exited, Progress
from deadpool_ext.protocol import ExitCode
from tests.unit_tests.policy.job import MEMBERS

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
