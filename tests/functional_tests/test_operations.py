"""Operating a running job, with real processes: planned swaps (a node
drained at an iteration boundary, by deadpool-ctl or a test's planned
event, or for being a straggler), a drain with no spare (a shrink), and
deadpool-ctl's status and stop, and its refusal of unsigned requests.

A planned swap redoes no iteration: the curve and every rank's final state
equal the failure-free run's bit for bit. These runs are longer than the
hot-swap tests' (24 iterations) so that the spares are ready before the
planned event (a drain waits for warming spares while training goes on).
"""

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

import forkserver
from dist_utils import (
    REPO,
    assert_same_state,
    checkpoint_state,
    curve,
    deadpool_args,
    launch_command,
    launch_deadpool,
    leftovers,
    must_succeed,
    read_metrics,
    tensorboard_texts,
    worker_env,
)
from tools.compare import shrink_difference
from deadpool_ext.events import read_events
from deadpool_ext.wire import Channel, connect

pytestmark = pytest.mark.integration

ITERS = 24
# 4 ranks: TP2 x DP2 on two 2-rank nodes (replica 1 on node 1).
SMALL = ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--use-tp-pp-dp-mapping"]
# name: (spare nodes, faults, extra flags). "drain": node 1's ranks ask for
# their node's drain at iteration 12's start, as deadpool-ctl drain 1 does;
# "straggler": node 1 computes 3 times as long from iteration 8, and the
# straggler watch (over 2 iterations) swaps it for the spare node.
PLANNED = {
    "drain": (1, ["drain:node=1:iter=12"], []),
    "straggler": (
        1,
        ["slow:node=1:iter=8:factor=3"],
        ["--deadpool-on-straggler", "swap", "--deadpool-straggler-window", "2"],
    ),
}


@pytest.fixture(scope="module")
def corpus(corpus_prefix):
    os.environ["HOT_SWAP_CORPUS"] = corpus_prefix
    return corpus_prefix


def launch(tmp, spares, faults, extra=()):
    return launch_deadpool(tmp, SMALL + list(extra), 2, spares, 2, faults, ITERS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("reference")
    must_succeed(launch(tmp, 0, []))
    return tmp


@pytest.fixture(scope="module", params=list(PLANNED))
def planned(request, tmp_path_factory, reference):
    spares, faults, extra = PLANNED[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    result = launch(tmp, spares, faults, extra)
    (tmp / "output.log").write_text(result[0].stdout + result[0].stderr)
    must_succeed(result)
    return request.param, tmp


def test_a_planned_swap_keeps_the_curve_and_every_rank_state_bit_for_bit(planned, reference):
    name, tmp = planned
    got, want = read_metrics(tmp / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [m["iteration"] for m in got] == list(range(1, ITERS + 1))
    assert curve(got) == curve(want)
    assert_same_state(
        checkpoint_state(str(tmp / "ckpt")), checkpoint_state(str(reference / "ckpt"))
    )


def assert_no_iteration_redone(events, decision) -> None:
    """Every rank stopped at the decision's boundary and went on from it."""
    stopped = {e["rank"]: e["iteration"] for e in events if e["event"] == "failure_seen"}
    assert len(stopped) == 4 and set(stopped.values()) == {decision["rollback_to"]}, stopped


def test_a_planned_swap_redoes_no_iteration_and_node_1_leaves(planned):
    """The survivors went on from their own snapshot of the boundary, the
    spares from the copy of it that node 1's ranks had sent their buddies.
    Nothing failed; node 1's workers left and its agent ended."""
    name, tmp = planned
    events = read_events(str(tmp / "events.jsonl"))
    kinds = [e["event"] for e in events]
    assert "failure_detected" not in kinds and kinds.count("recovered") == 1
    decision = next(e for e in events if e["event"] == "decision")
    assert decision["action"] == "recover" and decision["drained"] == [1]
    assert sorted(decision["replaced"].values()) == ["2.0", "2.1"]
    assert_no_iteration_redone(events, decision)
    restored = [e for e in events if e["event"] == "state_restored"]
    assert {e["rollback_to"] for e in restored} == {decision["rollback_to"]}
    assert sorted((e["rank"], e["source"]) for e in restored) == [
        (0, "own"),
        (1, "own"),
        (2, "buddy"),
        (3, "buddy"),
    ]
    released = [e for e in events if e["event"] == "released"]
    assert sorted(e["rank"] for e in released) == [2, 3]
    assert all(e["reason"] == "node 1 was drained" for e in released)
    assert [e["node"] for e in events if e["event"] == "node_drained"] == [1]
    asked = [e for e in events if e["event"] == "drain_requested"]
    if name == "drain":
        assert len(asked) == 1 and asked[0]["by"] == "--deadpool-inject"
    found = [e for e in events if e["event"] == "straggler"]
    if name == "drain":  # the watch's negative control: no node is slow here
        assert not found, found
    if name == "straggler":
        assert found and found[0]["node"] == 1 and found[0]["ratio"] > 2, found
        assert asked[0]["by"] == "straggler watch" and asked[0]["time"] > found[0]["time"]
        # Found within the window's reach: before iteration 8 + 2 + the beats' lag.
        assert found[0]["iteration"] <= 8 + 2 + 2, found
    lines = tensorboard_texts(str(tmp / "tb"), "deadpool/recovery")
    assert len(lines) == 1 and "node(s) [1] drained" in lines[0], lines


def test_a_drain_without_a_spare_shrinks_within_the_shrink_tolerance(tmp_path, reference):
    """No spare node: node 1's replica leaves (DP 2 -> 1) at the boundary,
    its shards re-cut from their buddies' copies of it; nothing redone."""
    must_succeed(launch(tmp_path, 0, ["drain:node=1:iter=12"]))
    got, want = read_metrics(tmp_path / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [m["iteration"] for m in got] == list(range(1, ITERS + 1))
    # The shrink's tolerance (compare.SHRINK_TOLERANCE; its negative control is
    # tests/functional_tests/test_shrink.py's): dropout on, drawn per sample.
    assert shrink_difference(got, want, fault_iteration=12) is None
    events = read_events(str(tmp_path / "events.jsonl"))
    decision = next(e for e in events if e["event"] == "decision")
    assert decision["action"] == "shrink" and decision["drained"] == [1]
    assert (decision["dp_before"], decision["dp_after"]) == (2, 1)
    assert_no_iteration_redone(events, decision)
    assert not leftovers(tmp_path)


# ----- deadpool-ctl on a live job -----
def ctl(run_dir, *args, timeout=60) -> subprocess.CompletedProcess:
    env = dict(worker_env(), DEADPOOL_RUN_DIR=str(run_dir))
    command = [sys.executable, "-m", "deadpool_ext.ctl", *args]
    return subprocess.run(
        command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def wait_for(predicate, job, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.poll() is None:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    return None


def events_of(tmp, kind):
    path = tmp / "events.jsonl"
    return [e for e in read_events(str(path)) if e["event"] == kind] if path.exists() else []


def test_deadpool_ctl_status_drain_and_stop_on_a_running_job(tmp_path, reference):
    """The whole operator's path: status; a request forged without the
    secret changes nothing and is counted; drain 1 (the spare node takes
    over at a boundary, nothing redone); stop (a checkpoint at the next
    boundary, exit 0). Every rank computes 12 times as long (a delay, the
    numbers unchanged) so that the commands land while the job trains."""
    run_dir = tmp_path / "run"
    slow = ["slow:node=0:iter=1:factor=12", "slow:node=1:iter=1:factor=12"]
    args = deadpool_args(tmp_path, SMALL, slow, ITERS) + [
        "--deadpool-straggler-factor",
        "0",
        "--deadpool-metrics-port",
        "0",
    ]
    command = launch_command(
        ["--standalone", "--nnodes", "2", "--spare-nodes", "1", "--nproc-per-node", "2"], args
    )
    env = dict(worker_env(), DEADPOOL_RUN_DIR=str(run_dir))
    with open(tmp_path / "job.log", "w") as log:
        job = forkserver.start_logged(command, env, REPO, log)
        try:
            assert wait_for(lambda: len(events_of(tmp_path, "spare_ready")) == 2, job)
            status = ctl(run_dir, "status")
            assert status.returncode == 0, status.stderr
            assert "node 0: active, ranks 0-1" in status.stdout, status.stdout
            assert "node 2: spare" in status.stdout and "requests refused: 0" in status.stdout
            forge_a_drain(run_dir)
            before = json.loads(ctl(run_dir, "status", "--json").stdout)
            assert before["rejected_requests"] == 1 and before["generation"] == 0
            assert before["nodes"]["1"]["role"] == "active" and not before["drains_pending"]
            metrics = scrape(tmp_path / "job.log")
            assert "deadpool_rejected_requests_total 1.0" in metrics, metrics
            drained = ctl(run_dir, "drain", "1", "--reason", "maintenance")
            assert drained.returncode == 0 and "leaves the job" in drained.stdout, drained
            assert wait_for(lambda: events_of(tmp_path, "recovered"), job)
            after = json.loads(ctl(run_dir, "status", "--json").stdout)
            assert after["nodes"]["1"]["role"] == "drained", after
            assert after["last_recovery"]["cause"] == "drain", after
            assert ctl(run_dir, "drain", "1").returncode == 1  # gone already: refused
            stopped = ctl(run_dir, "stop")
            assert stopped.returncode == 0, stopped
            assert job.wait(timeout=180) == 0, (tmp_path / "job.log").read_text()[-4000:]
        finally:
            if job.poll() is None:
                job.kill()
    events = read_events(str(tmp_path / "events.jsonl"))
    decisions = [e for e in events if e["event"] == "decision"]
    assert [(d["action"], d["drained"], d["stop"]) for d in decisions] == [
        ("recover", [1], False),
        ("recover", [], True),
    ]
    assert [e["reason"] for e in events if e["event"] == "drain_requested"] == ["maintenance"]
    stop = decisions[1]
    assert [e["iteration"] for e in events if e["event"] == "stopped"] == [stop["rollback_to"]]
    assert stop["rollback_to"] < ITERS
    got = read_metrics(tmp_path / "metrics.jsonl")
    want = read_metrics(reference / "metrics.jsonl")[: stop["rollback_to"]]
    assert [m["iteration"] for m in got] == list(range(1, stop["rollback_to"] + 1))
    assert curve(got) == curve(want)
    saved = [e for e in events if e["event"] == "checkpoint_saved"]
    assert len(saved) == 4 and (tmp_path / "ckpt" / f"iter_{stop['rollback_to']:07d}").is_dir()
    assert not os.listdir(run_dir)  # the job's file went with it
    assert not leftovers(tmp_path)


def forge_a_drain(run_dir) -> None:
    """A drain of node 1 signed with a wrong secret, on the requests' topic."""
    (job_file,) = os.listdir(run_dir)
    job = json.loads((run_dir / job_file).read_text())
    forger = Channel(connect(job["address"], job["port"], timeout_s=10), b"not the secret")
    forger.post("control", kind="control", request="drain", nonce="forged", node=1)
    time.sleep(0.5)


def scrape(log_path) -> str:
    """The job's Prometheus endpoint (its address is in the launcher's log)."""
    lines = log_path.read_text().splitlines()
    line = next(text for text in lines if "metrics at http" in text)
    url = line.split("metrics at ", 1)[1].strip()
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()
