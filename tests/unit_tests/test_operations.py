"""Operating a job, driven by hand (no worker processes): a drain carried
out end to end and one refused, a stop interrupted by a failure, a request
without the secret, the fault specs of operations, and deadpool-ctl's side
(finding the job, printing its status). What a drain, a stop or the
straggler watch decides is held without a store in tests/unit_tests/policy/;
the real runs are in tests/functional_tests/test_operations.py."""

import json
import os
import stat

import pytest

from deadpool_ext.control import ctl, jobs
from deadpool_ext.inject import InjectError, Injector, parse_fault, spares_ready_at
from deadpool_ext.protocol import Decision, ExitCode, JobState
from deadpool_ext.wire import Channel
from tests.unit_tests import store_job
from tests.unit_tests.store_job import SECRET, SPARES, Clock, new_store, reports, start


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


def test_slow_and_drain_specs():
    slow = parse_fault("slow:node=1:iter=10:factor=2.5")
    assert (slow.node, slow.iteration, slow.factor) == (1, 10, 2.5)
    injector = Injector([slow], rank=2, node=1, original=True)
    assert [injector.slowdown(i) for i in (9, 10, 30)] == [1.0, 2.5, 2.5]
    assert Injector([slow], rank=2, node=1, original=False).slowdown(30) == 1.0  # a spare
    assert parse_fault("drain:node=1:iter=4").point == "start"
    for spec in (
        "slow:node=1:iter=3:factor=1",
        "slow:node=1:iter=3",
        "slow:node=1:rank=2:iter=3:factor=2",
        "slow:node=1:iter=3:factor=x",
        "drain:rank=1:iter=4",
    ):
        with pytest.raises(InjectError):
            parse_fault(spec)


def test_slow_warm_holds_a_spare_nodes_spares_until_a_generation_trains():
    held = parse_fault("slow-warm:node=2:gen=1")
    assert spares_ready_at([held], node=2) == 1 and spares_ready_at([held], node=1) is None
    assert spares_ready_at([], node=2) is None
    # Not a fault of any phase: a rank of that node never fires it.
    injector = Injector([held], rank=4, node=2, original=True)
    assert not any(injector.due(phase, 1) for phase in ("start", "forward", "recovery"))
    for spec in ("slow-warm:node=2", "slow-warm:node=2:gen=0", "slow-warm:rank=2:gen=1"):
        with pytest.raises(InjectError):
            parse_fault(spec)


def test_deadpool_ctl_finds_the_standalone_job_of_this_host(tmp_path):
    env = {"DEADPOOL_RUN_DIR": str(tmp_path / "run")}
    opts = ctl.build_parser().parse_args(["--master-port", "0", "status"])
    with pytest.raises(ctl.UsageError, match="no deadpool-launch --standalone job"):
        ctl.find_job(opts, env)
    path = jobs.write_job("127.0.0.1", 1234, "s3cret", os.getpid(), env)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
    assert ctl.find_job(opts, env) == ("127.0.0.1", 1234, b"s3cret")
    jobs.write_job("127.0.0.1", 99, "x", 2**22 + 7, env)  # a launcher that is gone
    assert ctl.find_job(opts, env) == ("127.0.0.1", 1234, b"s3cret")
    assert len(os.listdir(tmp_path / "run")) == 1  # its file was removed
    given = ctl.build_parser().parse_args(["--master-port", "29500", "drain", "1"])
    with pytest.raises(ctl.UsageError, match="DEADPOOL_SECRET"):
        ctl.find_job(given, env)
    assert ctl.find_job(given, {"DEADPOOL_SECRET": "k"}) == ("127.0.0.1", 29500, b"k")


def test_deadpool_ctl_prints_the_status_for_a_person():
    coordinator, worker, _ = make_job()
    text = ctl.describe(json.loads(json.dumps(coordinator.status())))
    assert text.splitlines()[:4] == [
        "job: training, generation 0, iteration -, 4 of 4 ranks",
        "  node 0: active, ranks 0-1",
        "  node 1: active, ranks 2-3",
        "  node 2: spare",
    ]
    assert "spares: 2 ready ['2.0', '2.1']" in text and text.endswith("requests refused: 0")


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


def test_the_job_file_goes_only_to_a_folder_of_this_users_alone(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with pytest.raises(jobs.UnsafeRunDir, match="only it can open"):
        jobs.write_job("127.0.0.1", 1, "s", 5, {"DEADPOOL_RUN_DIR": str(shared)})
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(private)
    with pytest.raises(jobs.UnsafeRunDir):
        jobs.write_job("127.0.0.1", 1, "s", 5, {"DEADPOOL_RUN_DIR": str(tmp_path / "link")})
    assert os.listdir(private) == [] and os.listdir(shared) == []


def test_deadpool_ctl_refuses_an_address_without_a_port():
    opts = ctl.build_parser().parse_args(["--master-addr", "10.0.0.1", "status"])
    opts.master_port = None  # whatever MASTER_PORT the environment holds
    with pytest.raises(ctl.UsageError, match="--master-port"):
        ctl.find_job(opts, {})


def test_deadpool_ctl_turns_to_the_standby_when_node_0_does_not_answer(monkeypatch):
    asked = []

    def ask(host, port, secret, request, timeout_s):
        asked.append((host, port))
        if len(asked) == 1:
            raise ConnectionError("no job answers")
        return {"ok": True, "status": {}}

    monkeypatch.setattr(ctl, "ask", ask)
    opts = ctl.build_parser().parse_args(["--standby-addr", "node1", "status"])
    assert ctl.ask_where_it_runs(opts, "node0", 29500, b"k") == {"ok": True, "status": {}}
    assert asked == [("node0", 29500), ("node1", 29501)]
    opts = ctl.build_parser().parse_args(["status"])
    asked.clear()
    with pytest.raises(ConnectionError):
        ctl.ask_where_it_runs(opts, "node0", 29500, b"k")
