"""examples/slurm/cpu_demo.sh on a real Slurm cluster (tools/slurm_local.sh):
sbatch, 2 active nodes of 4 ranks and 1 warm spare node, one launcher per
node through srun.

* a failure-free submission;
* the same submission where a node dies mid-training: its slurmd, its step
  daemon and every process of the job on it are SIGKILLed at once, as a power
  loss would; the job must finish every iteration on the spare node with the
  failure-free curve and final checkpoints, bit for bit, and Slurm must see
  the node go DOWN;
* the same where the first node dies (the batch script, the store, the
  coordinator and ranks 0-3): the standby on the second node takes over as
  the coordinator, the job finishes on the spare node bit for bit, and the
  standby's node ends the job that Slurm would otherwise hold;
* one node's launcher alone SIGKILLed: its workers die with it;
* the same where the administrators mark an active node DRAIN in Slurm
  (scontrol update State=DRAIN): its agent asks for its drain, the spare
  node takes its ranks at the next iteration boundary, nothing is redone,
  and the curve and final checkpoints equal the failure-free job's;
* a submission stopped by SIGTERM sent to every job step (what
  `#SBATCH --signal=TERM@T` does before the time limit): every rank saves a
  checkpoint at the same iteration and the job ends cleanly.

Slow (a few minutes on 2 cores) and needs root and Slurm, so it runs only
under `make test-slurm` (DEADPOOL_TEST_SLURM=1), which starts the cluster.
With DEADPOOL_SLURM_REPORT=FILE it writes what it saw there
(docs/data/slurm-test.log is one such report).
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import REPO, assert_same_run, assert_same_state, saved_args, checkpoint_state, curve
from dist_utils import read_metrics
from deadpool_ext.events import read_events
from deadpool_ext.defaults import SLURM_STATE_INTERVAL_S

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        os.environ.get("DEADPOOL_TEST_SLURM") != "1",
        reason="needs a Slurm cluster: `make test-slurm` starts one and runs this",
    ),
    # Each test waits for whole Slurm jobs (and a test's fixtures for earlier ones).
    pytest.mark.timeout(3 * 1800),
]

SCRIPT = os.path.join(REPO, "examples", "slurm", "cpu_demo.sh")
ITERS = 20
# The demo's model and layout; fewer iterations, every one logged, a short
# heartbeat timeout so the lost node is declared within seconds.
ARGS = [
    "--train-iters",
    str(ITERS),
    "--save-interval",
    "10",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--deadpool-heartbeat-timeout",
    "5",
]
JOB_TIMEOUT = 1800  # seconds; a loaded 2-core machine starts 12 processes slowly
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


# ----- Slurm -----
def run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def job_fields(job: str) -> dict:
    text = run("scontrol", "show", "job", "-o", job)
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def submit(run_dir, extra=()) -> str:
    env = dict(
        os.environ,
        RUN_DIR=str(run_dir),
        PYTHON=sys.executable,
        PYTHONWARNINGS="ignore",
        OMP_NUM_THREADS="1",
    )
    out = subprocess.run(
        ["sbatch", "--parsable", "-o", str(run_dir) + ".out", SCRIPT, *ARGS, *extra],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return out.strip().split(";")[0]


def wait_for_job(job: str, timeout: float = JOB_TIMEOUT) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(job)
        if fields["JobState"] in TERMINAL:
            return fields
        time.sleep(2)
    run("scancel", job)
    raise AssertionError(f"job {job} did not end within {timeout:.0f} s")


def wait_for_iteration(run_dir, iteration: int, job: str, timeout: float = JOB_TIMEOUT):
    path = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and len(read_metrics(path)) >= iteration:
            return
        assert job_fields(job)["JobState"] in ("PENDING", "RUNNING"), job_fields(job)
        time.sleep(0.5)
    raise AssertionError(f"job {job} did not reach iteration {iteration}")


def job_nodes(job: str) -> list:
    return run("scontrol", "show", "hostnames", job_fields(job)["NodeList"]).split()


def node_state(node: str) -> str:
    return re.search(r"State=(\S+)", run("scontrol", "show", "node", node)).group(1)


def wait_for_node_down(node: str, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = node_state(node)
        if "DOWN" in state:
            return state
        time.sleep(2)
    raise AssertionError(f"Slurm never marked {node} DOWN (state {node_state(node)})")


def slurm_local(*args: str) -> str:
    return run(os.path.join(REPO, "tools", "slurm_local.sh"), *args)


def left_behind(run_dir) -> str:
    return subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout


def log_lines(run_dir) -> list:
    with open(str(run_dir) + ".out") as f:
        return [line.rstrip() for line in f if "Warning" not in line and "warn(" not in line]


# ----- the report -----
class Report:
    def __init__(self, path):
        self.path, self.lines = path, []

    def add(self, *lines: str) -> None:
        self.lines += list(lines)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


@pytest.fixture(scope="module")
def report():
    return Report(os.environ.get("DEADPOOL_SLURM_REPORT"))


@pytest.fixture(scope="module")
def cluster(report):
    try:
        run("scontrol", "ping")
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.fail(f"no Slurm controller ({error}): run `tools/slurm_local.sh start`")
    if not os.path.exists(os.path.join(REPO, "data", "corpus_text_document.bin")):
        pytest.fail("no data/corpus_text_document.bin: run `make data`")
    report.add(
        "# make test-slurm: examples/slurm/cpu_demo.sh on a one-machine Slurm cluster",
        f"# {time.strftime('%Y-%m-%d %H:%M:%S')}, {run('sbatch', '--version').strip()}",
        "",
        "$ sinfo -N",
        run("sinfo", "-N").rstrip(),
        "",
        f"$ sbatch examples/slurm/cpu_demo.sh {' '.join(ARGS)}",
        "",
    )


def timed_job(run_dir, report, name, extra=(), during=None) -> dict:
    start = time.monotonic()
    job = submit(run_dir, extra)
    if during is not None:
        during(job)
    fields = wait_for_job(job)
    seconds = time.monotonic() - start
    report.add(
        f"## {name}: job {job} on {fields['NodeList']}: {fields['JobState']}, exit "
        f"{fields['ExitCode']}, {seconds:.0f} s from sbatch to the end"
    )
    return {"job": job, "fields": fields, "seconds": seconds, "dir": run_dir}


@pytest.fixture(scope="module")
def reference(cluster, report, tmp_path_factory):
    return timed_job(tmp_path_factory.mktemp("slurm") / "reference", report, "failure-free")


@pytest.fixture(scope="module")
def node_failure(reference, report, tmp_path_factory):
    """Kill the second active node (deadpool node 1) in iteration 6."""
    seen = {}

    def kill_node(job):
        wait_for_iteration(run_dir, 5, job)
        victim = job_nodes(job)[1]
        seen["victim"] = victim
        seen["killed_at"] = time.time()
        seen["kill"] = slurm_local("kill-node", victim).strip()
        seen["state"] = wait_for_node_down(victim)

    run_dir = tmp_path_factory.mktemp("slurm") / "node-failure"
    try:
        result = timed_job(run_dir, report, "node failure", during=kill_node)
    finally:
        if "victim" in seen:
            slurm_local("revive-node", seen["victim"])
    result.update(seen)
    report.add(
        f"after iteration 5: tools/slurm_local.sh kill-node {seen['victim']} -> "
        f"{seen['kill']}; Slurm then marked it {seen['state']}"
    )
    return result


@pytest.fixture(scope="module")
def agent_killed(reference, report, tmp_path_factory):
    """Kill the second active node's agent alone in iteration 6 (that node's
    launcher, which keeps the standby, runs it as a child): its workers die
    with it (parent-death signal), its node stays up."""
    seen = {}

    def kill_agent(job):
        wait_for_iteration(run_dir, 5, job)
        node = job_nodes(job)[1]
        pids = [p for p in run("scontrol", "listpids", job, node).split() if p.isdigit()]
        agent = [p for p in pids if is_agent(cmdline(p))]
        seen.update(node=node, agent=agent, killed_at=time.time())
        for pid in agent:
            os.kill(int(pid), signal.SIGKILL)

    run_dir = tmp_path_factory.mktemp("slurm") / "agent-killed"
    result = timed_job(run_dir, report, "agent killed", during=kill_agent)
    result.update(seen)
    report.add(f"after iteration 5: kill -KILL {seen['agent']} (the agent on {seen['node']})")
    return result


@pytest.fixture(scope="module")
def first_node_failure(reference, report, tmp_path_factory):
    """Kill the first node (the batch script, the store, the coordinator and
    ranks 0-3) after iteration 12: the standby on the second node takes over
    as the coordinator and the spare node takes ranks 0-3."""
    seen = {}

    def kill_first_node(job):
        wait_for_iteration(run_dir, 12, job)
        victim = job_fields(job)["BatchHost"]
        seen.update(victim=victim, killed_at=time.time())
        seen["kill"] = slurm_local("kill-node", victim).strip()

    run_dir = tmp_path_factory.mktemp("slurm") / "first-node-failure"
    try:
        killed = timed_job(run_dir, report, "first node failure", during=kill_first_node)
        seen["ended_after"] = time.time() - seen["killed_at"]
    finally:
        if "victim" in seen:
            slurm_local("revive-node", seen["victim"])
    status = run_dir / f"launcher-status.{killed['job']}"
    seen["status"] = status.read_text().strip() if status.exists() else None
    seen["left_behind"] = left_behind(run_dir)
    report.add(
        f"after iteration 12: tools/slurm_local.sh kill-node {seen['victim']} (the batch "
        f"host) -> {seen['kill']}; the job ended {seen['ended_after']:.0f} s later, "
        f"launcher status {seen['status']}"
    )
    return dict(killed=killed, **seen)


def cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def is_agent(command: str) -> bool:
    """A node's agent: run by its launcher as a child where the launcher
    keeps the coordinator or the standby (nodes 0 and 1)."""
    return "-m deadpool_ext.control.agent" in command


def test_failure_free_submission_completes(reference):
    assert reference["fields"]["JobState"] == "COMPLETED", log_lines(reference["dir"])[-40:]
    assert [m["iteration"] for m in read_metrics(reference["dir"] / "metrics.jsonl")] == list(
        range(1, ITERS + 1)
    )
    assert not left_behind(reference["dir"])


def test_node_failure_is_hot_swapped_with_the_same_curve_bit_for_bit(
    node_failure, reference, report
):
    lines = log_lines(node_failure["dir"])
    assert node_failure["fields"]["JobState"] == "COMPLETED", lines[-60:]
    assert any("first node exited with 0" in line for line in lines)
    got = read_metrics(node_failure["dir"] / "metrics.jsonl")
    want = read_metrics(reference["dir"] / "metrics.jsonl")
    assert [m["iteration"] for m in got] == list(range(1, ITERS + 1))
    report.add(
        "",
        "iteration  lm loss (failure-free)   lm loss (node failure)   grad norm "
        "(failure-free)   grad norm (node failure)",
    )
    report.add(
        *[
            f"{a['iteration']:>9}  {a['lm_loss']!r:>22}   {b['lm_loss']!r:>22}   "
            f"{a['grad_norm']!r:>23}   {b['grad_norm']!r:>23}"
            for a, b in zip(want, got)
        ]
    )
    assert curve(got) == curve(want)
    report.add("curves (loss, grad norm, lr of every iteration): equal bit for bit")


def test_node_failure_final_checkpoints_equal_bit_for_bit(node_failure, reference, report):
    got = checkpoint_state(str(node_failure["dir"] / "checkpoints"))
    want = checkpoint_state(str(reference["dir"] / "checkpoints"))
    assert saved_args(str(reference["dir"] / "checkpoints")).world_size == 8
    assert_same_state(got, want)
    report.add(
        f"final checkpoints (iteration {ITERS}, torch_dist: model, optimizer, scheduler, "
        "RNG): equal bit for bit"
    )


def test_node_failure_events_tell_the_swap(node_failure, report):
    events = read_events(str(node_failure["dir"] / "events.jsonl"))
    detected = [e for e in events if e["event"] == "failure_detected"]
    decisions = [e for e in events if e["event"] == "decision"]
    assert len(detected) == 1 and "node 1 lost" in detected[0]["reason"]
    assert detected[0]["ranks"] == [4, 5, 6, 7]
    assert decisions and sorted(decisions[0]["replaced"]) == ["4", "5", "6", "7"]
    assert all(slot.startswith("2.") for slot in decisions[0]["replaced"].values())
    assert any(e["event"] == "recovered" for e in events)
    assert not left_behind(node_failure["dir"])
    killed = node_failure["killed_at"]
    report_coordinator_events(report, events, killed, "the kill")
    report.add(
        "",
        "batch output (warnings, and the same line from other ranks, dropped):",
        *lines_of_interest(node_failure["dir"]),
    )


def report_coordinator_events(report, events, since: float, what: str) -> None:
    """The coordinator's events, timed from ``since`` (``what`` happened then)."""
    report.add("", f"events (coordinator; seconds after {what}):")
    report.add(
        *[
            f"  {e['time'] - since:6.1f} s  {e['event']}: "
            + ", ".join(f"{k}={e[k]}" for k in e if k not in ("time", "rank", "event"))
            for e in events
            if e["rank"] == -1
        ]
    )


def lines_of_interest(run_dir) -> list:
    """The log without the lines every rank prints alike (rank 0's is kept)."""
    per_rank = (
        "no checkpoint in",
        "saved checkpoint",
        "deadpool mirror:",
        "resuming at",
        "failure seen",
        "exiting at iteration",
    )
    return [
        "  " + line
        for line in log_lines(run_dir)
        if not any(k in line for k in per_rank) or line.startswith("[rank 0]")
    ]


def test_sigterm_before_the_time_limit_saves_a_checkpoint(cluster, report, tmp_path):
    """scancel --signal=TERM reaches every job step but not the batch shell,
    exactly as `#SBATCH --signal=TERM@T` does at T seconds before the limit."""

    def signal_job(job):
        wait_for_iteration(run_dir, 4, job)
        run("scancel", "--signal=TERM", job)

    run_dir = tmp_path / "sigterm"
    result = timed_job(run_dir, report, "SIGTERM", ["--train-iters", "1000"], signal_job)
    lines = log_lines(run_dir)
    assert result["fields"]["JobState"] == "COMPLETED", lines[-60:]
    done = read_metrics(run_dir / "metrics.jsonl")
    saved = saved_args(str(run_dir / "checkpoints"))
    assert 4 <= len(done) < 1000 and saved.world_size == 8
    assert saved.iteration == done[-1]["iteration"]
    assert not left_behind(run_dir)
    assert any("first node exited with 0" in line for line in lines)
    report.add(
        f"after iteration 4: scancel --signal=TERM {result['job']} -> every rank saved "
        f"iteration {done[-1]['iteration']} and the job ended "
        f"{result['fields']['JobState']} (exit {result['fields']['ExitCode']})",
        "",
        "batch output:",
        *lines_of_interest(run_dir),
    )


def test_a_killed_agent_takes_its_workers_and_is_hot_swapped(agent_killed, reference):
    lines = log_lines(agent_killed["dir"])
    assert agent_killed["agent"], "no deadpool-launch process found on the node"
    assert agent_killed["fields"]["JobState"] == "COMPLETED", lines[-60:]
    got = read_metrics(agent_killed["dir"] / "metrics.jsonl")
    assert curve(got) == curve(read_metrics(reference["dir"] / "metrics.jsonl"))
    final = checkpoint_state(str(agent_killed["dir"] / "checkpoints"))
    assert_same_state(final, checkpoint_state(str(reference["dir"] / "checkpoints")))
    events = read_events(str(agent_killed["dir"] / "events.jsonl"))
    decisions = [e for e in events if e["event"] == "decision"]
    assert decisions and sorted(decisions[0]["replaced"]) == ["4", "5", "6", "7"]
    assert not left_behind(agent_killed["dir"])  # no orphaned worker


def test_first_node_failure_is_taken_over_by_the_standby_and_ends_the_job(first_node_failure):
    """Slurm keeps a --no-kill job RUNNING, without its batch host, until the
    time limit (docs/slurm.md): the standby, which finished the job as its
    coordinator, records the outcome and ends it."""
    killed = first_node_failure["killed"]
    assert killed["fields"]["JobState"] == "CANCELLED", killed["fields"]
    assert first_node_failure["status"] == "0", log_lines(killed["dir"])[-60:]
    assert not first_node_failure["left_behind"]


def test_first_node_failure_keeps_the_failure_free_curve_and_state_bit_for_bit(
    first_node_failure, reference, report
):
    run_dir = first_node_failure["killed"]["dir"]
    assert_same_run(run_dir, reference["dir"], ITERS, "checkpoints")
    events = read_events(str(run_dir / "events.jsonl"))
    takeover = [e for e in events if e["event"] == "takeover"]
    decisions = [e for e in events if e["event"] == "decision"]
    assert len(takeover) == 1 and sorted(decisions[-1]["replaced"]) == ["0", "1", "2", "3"]
    killed_at = first_node_failure["killed_at"]
    recovered = [e for e in events if e["event"] == "recovered"]
    report.add(
        f"the standby took over {takeover[0]['time'] - killed_at:.1f} s after the kill, "
        f"training again {recovered[-1]['time'] - killed_at:.1f} s after it; the curve "
        "and final checkpoints equal the failure-free job's bit for bit"
    )


# ----- the administrators drain a node -----
DRAIN_REASON = "maintenance: swap a DIMM (deadpool test)"
# The agents read Slurm's node state every SLURM_STATE_INTERVAL_S (5 s),
# which is 10 or more of this job's iterations: slowed 8 times (a pure
# delay, the numbers unchanged; the spares never slowed), the job is still
# training when the drain lands. The straggler watch is off: node 0 is
# slower than the spare node that takes node 1's ranks.
SLOWED = [
    "--deadpool-inject",
    "slow:node=0:iter=1:factor=8",
    "--deadpool-inject",
    "slow:node=1:iter=1:factor=8",
    "--deadpool-straggler-factor",
    "0",
]


def scontrol_update(node: str, *fields: str) -> None:
    run("scontrol", "update", f"NodeName={node}", *fields)


@pytest.fixture(scope="module")
def slurm_drain(reference, report, tmp_path_factory):
    """After iteration 5 the administrators mark the second active node
    (deadpool node 1) DRAIN in Slurm: its agent reads that, asks the
    coordinator to drain it, and at the next iteration boundary its ranks
    hand over to the spare node and it leaves; the job goes on."""
    seen = {}

    def drain_node(job):
        wait_for_iteration(run_dir, 5, job)
        node = job_nodes(job)[1]
        seen.update(node=node, marked_at=time.time())
        scontrol_update(node, "State=DRAIN", f"Reason={DRAIN_REASON}")
        seen["state"] = node_state(node)

    run_dir = tmp_path_factory.mktemp("slurm") / "slurm-drain"
    try:
        result = timed_job(run_dir, report, "Slurm drain", SLOWED, drain_node)
        seen["state_after"] = node_state(seen["node"])
    finally:
        if "node" in seen:
            scontrol_update(seen["node"], "State=RESUME")
    result.update(seen)
    report.add(
        f"({' '.join(SLOWED)})",
        f"after iteration 5: scontrol update NodeName={seen['node']} State=DRAIN "
        f"Reason='{DRAIN_REASON}' -> Slurm marked it {seen['state']} "
        f"({seen['state_after']} once the job ended; then State=RESUME)",
    )
    return result


def test_a_node_slurm_marks_drain_leaves_at_an_iteration_boundary(slurm_drain, report):
    """Nothing failed and nothing is redone: every rank stopped at the
    decision's boundary, the spare node took node 1's ranks, node 1 left."""
    lines = log_lines(slurm_drain["dir"])
    assert "DRAIN" in slurm_drain["state"], slurm_drain["state"]
    assert slurm_drain["fields"]["JobState"] == "COMPLETED", lines[-60:]
    assert slurm_drain["fields"]["ExitCode"] == "0:0", slurm_drain["fields"]
    assert any("first node exited with 0" in line for line in lines)
    node = slurm_drain["node"]
    events = read_events(str(slurm_drain["dir"] / "events.jsonl"))
    kinds = [e["event"] for e in events]
    assert "failure_detected" not in kinds, [e for e in events if e["event"] == "failure_detected"]
    asked = [e for e in events if e["event"] == "drain_requested"]
    assert [(e["node"], e["by"]) for e in asked] == [(1, "slurm")], asked
    assert asked[0]["reason"].startswith(f"Slurm marked {node} ") and asked[0]["reason"].endswith(
        f"DRAIN: {DRAIN_REASON}"
    ), asked
    # Read within one polling interval (and scontrol's answer, on a loaded machine).
    assert 0 < asked[0]["time"] - slurm_drain["marked_at"] < SLURM_STATE_INTERVAL_S + 10, asked
    decision = next(e for e in events if e["event"] == "decision")
    assert decision["action"] == "recover" and decision["drained"] == [1], decision
    assert sorted(decision["replaced"]) == ["4", "5", "6", "7"], decision
    assert all(slot.startswith("2.") for slot in decision["replaced"].values()), decision
    stopped = {e["rank"]: e["iteration"] for e in events if e["event"] == "failure_seen"}
    assert sorted(stopped) == list(range(8)), stopped
    assert set(stopped.values()) == {decision["rollback_to"]}, (stopped, decision)
    assert decision["rollback_to"] < ITERS, decision  # the drain landed before the end
    assert [e["node"] for e in events if e["event"] == "node_drained"] == [1]
    said = [line for line in lines if "asking to drain this node" in line]
    assert len(said) == 1 and f"Slurm marked {node} " in said[0], said
    assert not left_behind(slurm_drain["dir"])
    marked = slurm_drain["marked_at"]
    report_coordinator_events(report, events, marked, "scontrol marked the node DRAIN")
    report.add(f"  the agent of {node}: {said[0]}")


def test_a_slurm_drain_keeps_the_failure_free_curve_and_state_bit_for_bit(
    slurm_drain, reference, report
):
    events = read_events(str(slurm_drain["dir"] / "events.jsonl"))
    assert [e["drained"] for e in events if e["event"] == "decision"] == [[1]]  # a swap to compare
    assert_same_run(slurm_drain["dir"], reference["dir"], ITERS, "checkpoints")
    report.add(
        "Slurm drain: the curve and final checkpoints equal the failure-free job's bit for bit"
    )
