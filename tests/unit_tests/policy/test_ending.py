"""What the end of a job says (policy/ending.py's ``at_end``): the
launcher's exit code once every rank is done after a stop asked for or a
checkpoint decided, and after ranks that never finished."""

from deadpool_ext.policy.ending import at_end
from deadpool_ext.protocol import Decision, ExitCode
from tests.unit_tests.policy.job import JOB, MEMBERS, S, replace

EVERY_RANK = frozenset(MEMBERS)


def test_a_stop_asked_for_ends_the_job_well():
    stop = Decision(gen=1, action="recover", rollback_to=5, members=MEMBERS, stop=True)
    stopped = replace(JOB, gen=1, state=S.STOPPING, stopping=stop, done=EVERY_RANK)
    code, said = at_end(stopped)
    assert code == ExitCode.OK and [n.event for n in said] == ["stopped"]


def test_a_checkpoint_decided_ends_the_job_stopped_with_its_checkpoint():
    members = {0: "0.0", 1: "0.1"}
    checkpoint = Decision(gen=1, action="checkpoint", rollback_to=5, members=members)
    saved = replace(
        JOB, gen=1, members=members, state=S.STOPPING, stopping=checkpoint, done=frozenset(members)
    )
    assert at_end(saved)[0] == ExitCode.STOPPED_WITH_CHECKPOINT


def test_a_job_whose_ranks_did_not_all_finish_failed():
    assert at_end(replace(JOB, done=frozenset({0, 1})))[0] == ExitCode.FAILED
