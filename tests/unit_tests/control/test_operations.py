"""Requests to a running job (deadpool_ext/control/operations.py), driven by
hand over a real store with a fake clock (no worker processes): a drain
carried out end to end and one refused, a stop interrupted by a failure,
and a request without the secret. What a drain, a stop or the straggler
watch decides is held without a store in tests/unit_tests/policy/; the real
runs are in tests/functional_tests/test_operations.py."""

from deadpool_ext.protocol import Decision, ExitCode, JobState
from deadpool_ext.wire import Channel
from tests.unit_tests.control import store_job
from tests.unit_tests.control.store_job import SECRET, SPARES, Clock, new_store, reports, start


def make_job(spares=SPARES, on_spares_exhausted="shrink", **settings):
    store, clock = new_store(), Clock()
    job_settings = store_job.settings(on_spares_exhausted, **settings)
    coordinator = store_job.coordinator_on(store, clock, job_settings)
    worker = Channel(store, SECRET)
    start(worker, coordinator, spares)
    coordinator.enter(JobState.TRAINING)
    return coordinator, worker, clock


def ask(worker, coordinator, request, nonce="n1", **fields):
    worker.post("control", kind="control", request=request, nonce=nonce, **fields)
    coordinator.step()
    return worker.get(f"control/reply/{nonce}")


def report_all(worker, gen, own=(5, 4), members=None):
    reports(worker, gen, range(4), own, members=members)


def resume_all(coordinator, worker):
    for rank, slot in coordinator.record.membership.members.items():
        worker.post("coordinator", kind="resumed", gen=coordinator.gen, rank=rank, slot=slot)
    coordinator.step()


def test_a_drain_hands_node_1_to_the_spare_node_at_the_boundary_and_it_may_join_again():
    coordinator, worker, _ = make_job()
    agent = worker.reader("agent/1")
    answer = ask(worker, coordinator, "drain", node=1, reason="maintenance")
    assert answer == {"ok": True, "message": "node 1 leaves the job at the next iteration boundary"}
    gen = worker.get("gen")
    assert gen["state"] == "draining" and gen["boundary"] is True and gen["lost"] == []
    assert gen["assign"] == {"2": "2.0", "3": "2.1"}  # they build while ranks reach the boundary
    report_all(worker, 1)
    coordinator.step()
    decision = Decision.from_message(worker.get("decision/1"))
    assert decision.action == "recover" and decision.rollback_to == 5 and decision.drained == [1]
    assert decision.replaced == {2: "2.0", 3: "2.1"} and decision.from_buddy == [2, 3]
    assert decision.released == ["1.0", "1.1"] and decision.reason == "node(s) [1] drained"
    assert agent.poll() == [{"kind": "leave", "slot": None}]
    resume_all(coordinator, worker)
    status = coordinator.status()
    assert status["state"] == "training" and status["nodes"]["1"]["role"] == "drained"
    assert status["recoveries"] == {"drain": 1} and status["last_recovery"]["cause"] == "drain"
    # Its workers' release is no failure; the node can come back as spares.
    worker.post("coordinator", kind="exit", slot="1.0", code=int(ExitCode.RELEASED))
    worker.post("coordinator", kind="node", node=1, active=False, nproc=2, join=True, nonce="j")
    coordinator.step()
    assert coordinator.state == "training" and worker.get("admit/j") == {"accepted": True}
    assert coordinator.status()["nodes"]["1"]["role"] == "spare"


def test_a_drain_the_policy_refuses_leaves_no_drain_pending():
    coordinator, worker, _ = make_job(spares=(), on_spares_exhausted="abort")
    ask(worker, coordinator, "drain", node=1)
    report_all(worker, 1)
    coordinator.step()
    decision = Decision.from_message(worker.get("decision/1"))
    # Nothing can carry it out: the job goes on as it was, never stops for it.
    assert decision.action == "recover" and decision.drained == [] and decision.replaced == {}
    assert "not drained" in decision.warnings[0] and "abort" in decision.warnings[0]
    resume_all(coordinator, worker)
    assert coordinator.state == "training" and coordinator.status()["drains_pending"] == {}


def test_a_request_without_the_secret_changes_nothing_and_is_counted():
    coordinator, worker, _ = make_job()
    forger = Channel(worker.store, b"wrong secret")
    for request in ("drain", "stop", "status"):
        forger.post("control", kind="control", request=request, nonce=request, node=1)
    coordinator.step()
    assert coordinator.gen == 0 and coordinator.state == "training"
    assert not coordinator.record.drains and coordinator.record.stop_request is None
    assert all(worker.get(f"control/reply/{n}") is None for n in ("drain", "stop", "status"))
    # Signed but malformed: counted too, never acted on.
    worker.post("control", kind="control", request="reboot", nonce="x")
    worker.post("control", kind="exit", slot="1.1", code=-9)
    coordinator.step()
    assert coordinator.gen == 0 and not coordinator.record.lost
    assert ask(worker, coordinator, "status")["status"]["rejected_requests"] == 5


def test_a_stop_interrupted_by_a_failure_recovers_first_and_stops_after():
    coordinator, worker, _ = make_job()
    ask(worker, coordinator, "stop")
    report_all(worker, 1)
    coordinator.step()
    assert Decision.from_message(worker.get("decision/1")).stop
    worker.post("coordinator", kind="exit", slot="1.1", code=-9)  # before every rank resumed
    coordinator.step()
    report_all(worker, 2)
    coordinator.step()
    swap = Decision.from_message(worker.get("decision/2"))
    assert not swap.stop and swap.replaced == {3: "2.0"}
    resume_all(coordinator, worker)
    assert coordinator.state == "draining" and coordinator.round.cause == "stop"  # asked for still
    report_all(worker, 3, members=coordinator.record.membership.members)
    coordinator.step()
    assert Decision.from_message(worker.get("decision/3")).stop
