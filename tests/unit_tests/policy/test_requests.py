"""What an operator's request to a running job gets (policy/requests.py,
answered by control/operations.py's ``answer``, a pure function of the
request and the job's view): the answer's words, and what it asks the
coordinator to do (a drain queued, a stop asked for), or nothing when it
is refused."""

from deadpool_ext.control.operations import answer
from deadpool_ext.policy.effects import QueueDrain, StopAsked
from deadpool_ext.protocol import ControlRequest
from tests.unit_tests.policy.job import JOB, S, plan, replace


def ask(view, request: str, **fields):
    return answer(ControlRequest(request=request, nonce="n1", **fields), view, dict)


def test_a_drain_is_queued_for_the_next_iteration_boundary():
    reply, effects = ask(JOB, "drain", node=1)
    assert reply == {"ok": True, "message": "node 1 leaves the job at the next iteration boundary"}
    assert effects == (QueueDrain(1, "asked by deadpool-ctl", "deadpool-ctl"),)


def test_drains_the_job_cannot_take_are_refused_with_the_reason():
    reply, effects = ask(JOB, "drain", node=7)
    assert reply["message"].startswith("no node 7") and effects == ()
    reply, effects = ask(JOB, "stop", reason="the allocation ends")
    assert reply["ok"] and effects == (StopAsked("the allocation ends", "deadpool-ctl"),)
    stopping = replace(JOB, gen=1, state=S.DRAINING, stop_request="the allocation ends")
    assert ask(stopping, "drain", node=1) == ({"ok": False, "message": "the job is ending"}, ())


def test_a_stop_in_a_job_without_save_says_nothing_is_saved():
    unsaved = replace(JOB, plan=replace(plan(pp=1, tp_pp_dp=False), saves=False))
    reply, _ = ask(unsaved, "stop")
    assert "no --save: nothing is saved" in reply["message"]
