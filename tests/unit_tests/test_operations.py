"""Operating a job, driven by hand (no worker processes): drains, stops
and status asked for on the requests' topic, a request without the secret,
the straggler watch, and deadpool-ctl's side (finding the job, printing
its status). The real runs are in tests/functional_tests/test_operations.py."""

import dataclasses
import json
import os
import stat

import pytest

from deadpool_ext.control import ctl, jobs
from deadpool_ext.control.coordinator import Coordinator
from deadpool_ext.control.ports import free_port
from deadpool_ext.policy.effects import Note
from deadpool_ext.policy.stragglers import judge, node_times
from deadpool_ext.policy.triggers import stragglers
from deadpool_ext.policy.view import JobView, Sighting
from deadpool_ext.inject import InjectError, Injector, parse_fault, spares_ready_at
from deadpool_ext.protocol import CoordinatorSettings, Decision, ExitCode, JobState
from deadpool_ext.wire import Channel, connect
from tests.unit_tests.test_coordinator import BUDDY, SECRET, Clock


def make_job(spares=("2.0", "2.1"), on_spares_exhausted="shrink", **settings):
    store = connect("127.0.0.1", free_port(), timeout_s=10, is_master=True)
    clock = Clock()
    coordinator = Coordinator(
        Channel(store, SECRET),
        nnodes=2,
        spare_nodes=1,
        nproc=2,
        settings=CoordinatorSettings(
            **{"heartbeat_timeout": 3.0, "spare_wait": 0.0, **settings},
            on_spares_exhausted=on_spares_exhausted,
        ),
        clock=clock,
    )
    coordinator.detector.every_s = 0.0
    worker = Channel(store, SECRET)
    plan = dict(kind="plan", gen=0, buddy=BUDDY, owner=BUDDY, tp=1, pp=1, tp_pp_dp=False)
    worker.post("coordinator", **plan)
    for slot in spares:
        worker.post("coordinator", kind="spare_ready", slot=slot)
    coordinator.step()
    coordinator.enter(JobState.TRAINING)
    return coordinator, worker, clock


def ask(worker, coordinator, request, nonce="n1", **fields):
    worker.post("control", kind="control", request=request, nonce=nonce, **fields)
    coordinator.step()
    return worker.get(f"control/reply/{nonce}")


def report_all(worker, gen, own=(5, 4), members=None):
    for rank in range(4):
        slot = members[rank] if members else f"{rank // 2}.{rank % 2}"
        worker.post(
            "coordinator",
            kind="report",
            gen=gen,
            rank=rank,
            slot=slot,
            own=list(own),
            held=list(own),
        )


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


def test_a_drain_without_a_spare_shrinks_or_is_refused_by_the_policy():
    coordinator, worker, _ = make_job(spares=())
    ask(worker, coordinator, "drain", node=1)
    report_all(worker, 1)
    coordinator.step()
    decision = Decision.from_message(worker.get("decision/1"))
    assert decision.action == "shrink" and decision.drained == [1]
    assert (decision.old_dp, decision.new_dp) == (4, 2)
    assert sorted(decision.released) == ["1.0", "1.1"]

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


def test_drains_the_job_cannot_take_are_refused_with_the_reason():
    coordinator, worker, _ = make_job()
    assert ask(worker, coordinator, "drain", nonce="a", node=7)["message"].startswith("no node 7")
    assert ask(worker, coordinator, "stop", nonce="b")["ok"]
    assert ask(worker, coordinator, "drain", nonce="c", node=1) == {
        "ok": False,
        "message": "the job is ending",
    }


def test_a_stop_saves_at_the_boundary_and_the_job_ends_well():
    coordinator, worker, _ = make_job()
    assert ask(worker, coordinator, "stop", reason="the allocation ends")["ok"]
    assert worker.get("gen")["boundary"] is True
    report_all(worker, 1)
    coordinator.step()
    decision = Decision.from_message(worker.get("decision/1"))
    assert decision.stop and decision.rollback_to == 5 and decision.replaced == {}
    assert decision.reason == "the allocation ends"
    resume_all(coordinator, worker)
    assert coordinator.state == "stopping"
    for rank, slot in coordinator.record.membership.members.items():
        worker.post("coordinator", kind="done", rank=rank, slot=slot)
    assert coordinator.run(poll_s=0.0) == ExitCode.OK


def test_a_drain_waits_for_warming_spares_while_training_goes_on():
    coordinator, worker, clock = make_job(spares=(), spare_wait=30.0)
    for slot in ("2.0", "2.1"):
        worker.put(f"hb/{slot}", iteration=None, state="starting")
    coordinator.step()
    ask(worker, coordinator, "drain", node=1)
    assert coordinator.state == "training" and coordinator.record.drains == {
        1: "asked by deadpool-ctl"
    }
    for slot in ("2.0", "2.1"):
        worker.post("coordinator", kind="spare_ready", slot=slot)
    coordinator.step()
    assert coordinator.state == "draining" and worker.get("gen")["assign"] == {
        "2": "2.0",
        "3": "2.1",
    }


def beat(worker, slot, seconds, count=2, iteration=9, seq=1):
    compute = {"seconds": seconds, "count": count, "iteration": iteration}
    worker.put(f"hb/{slot}", iteration=iteration, state="training", compute=compute, seq=seq)


def test_a_straggler_is_reported_and_with_swap_drained_to_a_ready_spare_node():
    coordinator, worker, _ = make_job(straggler_window=2, on_straggler="swap")
    for slot, seconds in {"0.0": 0.10, "0.1": 0.11, "1.0": 0.19, "1.1": 0.23}.items():
        beat(worker, slot, seconds)
    coordinator.step()
    assert coordinator.state == "training"  # 0.21 is not twice 0.105 (the default factor)
    for slot, seconds in {"1.0": 0.31, "1.1": 0.35}.items():
        beat(worker, slot, seconds, seq=2)
    coordinator.step()
    assert coordinator.state == "draining" and coordinator.round.leaving == [1]
    stragglers = coordinator.status()["stragglers"]
    assert stragglers["1"]["ratio"] == pytest.approx(0.33 / 0.105, rel=0.01)


def compute(seconds, count=3, iteration=7):
    return {"seconds": seconds, "count": count, "iteration": iteration}


def test_the_straggler_watch_compares_each_node_with_the_others():
    times = {"0.0": compute(1.0), "1.0": compute(1.2), "2.0": compute(1.4)}
    assert judge(node_times(times, list(times), 3), 1.5) == {}  # 1.4 is not 1.5 x 1.1
    times["2.0"] = compute(3.0, iteration=8)
    found = judge(node_times(times, list(times), 3), 1.5)
    assert [(s.node, s.others_s, s.iteration) for s in found.values()] == [(2, 1.1, 8)]
    # Said once while it lasts.
    settings = CoordinatorSettings(straggler_factor=1.5, straggler_window=3)
    view = JobView(gen=0, state=JobState.TRAINING, settings=settings, sighting=Sighting())
    view = dataclasses.replace(view, node_times=node_times(times, list(times), 3))
    said = [e for e in stragglers(view) if isinstance(e, Note) and e.event == "straggler"]
    assert len(said) == 1 and said[0].fields["node"] == 2
    again = dataclasses.replace(view, stragglers=found)
    assert not [e for e in stragglers(again) if isinstance(e, Note) and e.event == "straggler"]
    times["1.1"] = compute(9.0, count=2, iteration=8)  # its window is not full
    assert node_times(times, list(times), 3)[1][0] == 1.2
    # A node's time is its ranks' median: one noisy rank does not make it slow.
    times["0.1"], times["0.2"] = compute(5.0, iteration=8), compute(1.1, iteration=8)
    assert node_times(times, list(times), 3)[0][0] == 1.1
    assert 0 not in judge(node_times(times, list(times), 3), 1.5)
    kept = node_times(times, ["0.0", "1.0"], 3)  # only the live members count
    assert 2 not in kept and judge(kept, 1.5) == {}
    assert judge(node_times(times, list(times), 3), 0) == {}


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


def test_a_straggler_is_asked_to_drain_once_while_it_stays_one():
    coordinator, worker, _ = make_job(straggler_window=2, on_straggler="swap")
    for slot, seconds in {"0.0": 0.1, "0.1": 0.1, "1.0": 0.4, "1.1": 0.4}.items():
        beat(worker, slot, seconds)
    coordinator.step()
    assert coordinator.record.drains == {1: "straggler: 4.0x the other nodes' compute time"}
    coordinator.record.drains.clear()  # as a drain the policy refused leaves it
    coordinator.enter(JobState.RECOVERING)
    coordinator.enter(JobState.REBUILDING)
    coordinator.enter(JobState.TRAINING)
    coordinator.judge(coordinator.look(coordinator.clock()))
    assert coordinator.record.drains == {}  # not again while it stays slow


def test_a_node_lost_before_its_drain_is_not_sent_off_as_drained():
    coordinator, worker, _ = make_job(spare_wait=30.0, spares=())
    for slot in ("2.0", "2.1"):
        worker.put(f"hb/{slot}", iteration=None, state="starting")
    coordinator.step()
    ask(worker, coordinator, "drain", node=2)  # a spare node, still warming: waits... no rank
    assert coordinator.status()["nodes"]["2"]["role"] == "drained"  # no rank: it left at once
    coordinator, worker, _ = make_job(spare_wait=30.0, spares=())
    for slot in ("2.0", "2.1"):
        worker.put(f"hb/{slot}", iteration=None, state="starting")
    coordinator.step()
    ask(worker, coordinator, "drain", node=1)  # waits for the warming spares
    coordinator.record.membership.lose(
        coordinator.record.membership.slots_of(1)
    )  # then the node dies
    coordinator.judge()
    assert coordinator.record.drains == {} and 1 not in coordinator.record.drained_nodes


def test_a_stop_in_a_job_without_save_says_nothing_is_saved():
    coordinator, worker, _ = make_job()
    coordinator.record.plan.saves = False
    assert "no --save: nothing is saved" in ask(worker, coordinator, "stop")["message"]


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
