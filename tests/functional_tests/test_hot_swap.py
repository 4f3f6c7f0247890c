"""Hot-swap recovery with real processes: deadpool-launch, emulated nodes,
warm spares, and SIGKILL / SIGSTOP injected at chosen points.

Every recovered run must finish every iteration with the same loss,
grad-norm and lr curve as the failure-free run, bit for bit, and every
rank's final checkpoint (model, optimizer shard, scheduler, RNG) must be
identical. Runs are shared between tests through module fixtures.
"""

import json
import os
import re

import pytest

from dist_utils import (
    COMMON,
    MOE,
    float32,
    tensorboard_scalars,
    tensorboard_texts,
    assert_same_run,
    assert_same_state,
    saved_args,
    checkpoint_state,
    curve,
    deadpool_args,
    launch_deadpool,
    launch_on_nodes,
    readable_logs,
    leftovers,
    must_succeed,
    read_metrics,
    worker_env,
)
from deadpool_ext.control.zygote import FORK_WORKERS_ENV
from deadpool_ext.events import read_events
from megatron.training.checkpointing import read_tracker

# Every test here starts real processes.
pytestmark = pytest.mark.integration

ITERS = 8
SMALL = [
    "--num-layers",
    "2",
    "--tensor-model-parallel-size",
    "2",
    "--use-tp-pp-dp-mapping",
]  # 4 ranks: TP2 x DP2, DP peers on different nodes
WITH_PP = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--use-tp-pp-dp-mapping",
]  # 8 ranks: TP2 x PP2 x DP2
# WITH_PP on the interleaved schedule: two model chunks of one layer per
# pipeline rank (virtual stages 0-3 over the two stages).
WITH_VPP = WITH_PP + ["--num-layers-per-virtual-pipeline-stage", "1"]
# name: (layout flags, nodes, spare nodes, ranks per node, faults)
SCENARIOS = {
    "forward+grad-reduce": (
        SMALL,
        2,
        1,
        2,
        ["kill:rank=0:iter=2:phase=forward", "kill:rank=3:iter=5:phase=grad-reduce"],
    ),
    "backward+optimizer": (
        SMALL,
        2,
        1,
        2,
        ["kill:rank=2:iter=3:phase=backward", "kill:rank=1:iter=6:phase=optimizer"],
    ),
    # rank 0 dies while the job recovers from rank 3's death in the mirror.
    "mirror+recovery": (
        SMALL,
        2,
        1,
        2,
        ["kill:rank=3:iter=3:phase=mirror", "kill:rank=0:phase=recovery"],
    ),
    "two-nodes": (SMALL, 2, 2, 2, ["kill:node=1:iter=3", "kill:node=0:iter=6"]),
    "hang": (SMALL, 2, 1, 2, ["hang:rank=2:iter=4"]),
    # Rank 1 stops in forward, heartbeats going on, and never notices rank
    # 2's death: it is killed as stuck, and both come back from buddies.
    "stuck": (
        SMALL,
        2,
        1,
        2,
        ["stall:rank=1:iter=4:phase=forward", "kill:rank=2:iter=4:phase=forward"],
    ),
    # Rank 1 stops in backward for good, heartbeats going on, and nothing else
    # fails: its peers wait on it; the progress watch kills it.
    "stall": (SMALL, 2, 1, 2, ["stall:rank=1:iter=4:phase=backward"]),
    # Rank 2 runs out of memory in backward: it reports its own failure
    # (exit LOCAL_FAILURE) and is replaced like a dead one.
    "oom": (SMALL, 2, 1, 2, ["oom:rank=2:iter=4:phase=backward"]),
    # Rank 1's loss turns NaN once in iteration 4: every rank goes back to the
    # iteration's start from its own snapshot and redoes it (nobody replaced).
    "nan": (SMALL, 2, 1, 2, ["nan:rank=1:iter=4"]),
    # Silent data corruption (grad mode; ranks 1 and 3 are replicas, 3 holds
    # 1's mirror): a parameter of rank 1 after step 2 (the replicas' digests
    # differ at 3's start: rolled back), rank 3's copy of rank 1's shard (its
    # replay fails: resent whole, training untouched), rank 2's Adam state
    # after step 4 (its buddy's replay disagrees: rolled back) and again
    # after step 6 (caught twice: rank 2 is swapped for a spare).
    "flips": (
        SMALL,
        2,
        1,
        2,
        [
            "flip:rank=1:iter=2:target=param",
            "flip:rank=3:iter=3:target=mirror",
            "flip:rank=2:iter=4:target=optimizer",
            "flip:rank=2:iter=6:target=optimizer",
        ],
    ),
    "pp-node": (WITH_PP, 2, 1, 4, ["kill:node=1:iter=4:phase=backward"]),
    # Rank 6 (second stage of replica 1) dies in forward, between the
    # interleaved schedule's chunks; its spare builds both chunks.
    "interleaved-forward": (WITH_VPP, 2, 1, 4, ["kill:rank=6:iter=4:phase=forward"]),
    # Saves every 2 iterations: rank 3's fails at 2 (a shard file), rank 0's at
    # 6 (common.pt), with a recovery between; training goes on through both.
    "disk-full": (
        SMALL,
        2,
        1,
        2,
        ["disk-full:rank=3:iter=2", "kill:rank=1:iter=5:phase=backward", "disk-full:rank=0:iter=6"],
    ),
    # Node 1's agent alone is killed: its workers die with it (no orphan
    # keeps a rank), and the spare node takes the node's place.
    "agent-killed": (SMALL, 2, 1, 2, ["kill-agent:node=1:iter=4"]),
    # A rank dies 30 ms into an asynchronous save: the survivors abandon it.
    "save-kill": (SMALL, 2, 1, 2, ["kill:rank=2:iter=4:phase=save:delay=30"]),
    # Activation recompute, dropout on (0.1), killed in backward, where the
    # layers run again. Compared with the reference without recompute, which
    # recompute equals bit for bit (test_recompute.py).
    "recompute-full": (SMALL, 2, 1, 2, ["kill:rank=2:iter=3:phase=backward"]),
    "recompute-selective": (SMALL, 2, 1, 2, ["kill:node=1:iter=4:phase=backward"]),
    # Spare node 2's GPUs report uncorrectable ECC errors to its agent (a
    # fake NVML): node 1's ranks go to spare node 3.
    "unhealthy-spare": (SMALL, 2, 2, 2, ["kill:node=1:iter=3:phase=backward"]),
    # MoE: node 1 holds ranks 2 and 3, one expert-parallel group of the
    # first stage; their expert shards come back from ranks 0 and 1.
    "moe-node": (MOE, 4, 1, 2, ["kill:node=1:iter=4:phase=backward"]),
    # Two failures in a row: rank 7 dies in forward, rank 2 while the job
    # recovers from it.
    "moe-twice": (MOE, 4, 1, 2, ["kill:rank=7:iter=3:phase=forward", "kill:rank=2:phase=recovery"]),
    # --deadpool-rebuild-groups changed: the survivors keep the groups no
    # replaced rank was in. Node 1 (data-parallel replica 1, both pipeline
    # stages) is lost.
    "keep-pp-node": (WITH_PP, 2, 1, 4, ["kill:node=1:iter=4:phase=backward"]),
    # Two failures in a row, each keeping what the other left.
    "keep-forward+grad-reduce": (
        SMALL,
        2,
        1,
        2,
        ["kill:rank=0:iter=2:phase=forward", "kill:rank=3:iter=5:phase=grad-reduce"],
    ),
    # A failure during the recovery: the kept groups of the interrupted
    # rebuild go too.
    "keep-mirror+recovery": (
        SMALL,
        2,
        1,
        2,
        ["kill:rank=3:iter=3:phase=mirror", "kill:rank=0:phase=recovery"],
    ),
    # A survivor blocked where no failure reaches it (rank 1 stalls): its
    # heartbeat thread releases all it holds, and its groups are made again.
    "keep-stuck": (
        SMALL,
        2,
        1,
        2,
        ["stall:rank=1:iter=4:phase=forward", "kill:rank=2:iter=4:phase=forward"],
    ),
}
KEEP = ["--deadpool-rebuild-groups", "changed"]
# Workers started each from its command (as on a GPU node) rather than
# forked from their node's zygote: the agent kills the hung one.
STARTED = {"hang"}
# Flags beyond the layout, per scenario.
EXTRA = {
    "stall": ["--deadpool-progress-timeout", "6"],
    "disk-full": ["--save-interval", "2"],
    # The plan of the saves before the kill is made again for the new groups;
    # only saves of multiples of 4 and the latest stay.
    "save-kill": ["--save-interval", "2", "--async-save", "--use-persistent-ckpt-worker"]
    + ["--ckpt-assume-constant-structure", "--save-retain-interval", "4"],
    "recompute-full": ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    + ["--recompute-num-layers", "1"],
    "recompute-selective": ["--recompute-activations"],
    "flips": ["--deadpool-mirror-mode", "grad"],
    **{name: KEEP for name in SCENARIOS if name.startswith("keep-")},
}


# name: (layout flags, nodes, ranks per node) of each failure-free run
REFERENCE_LAYOUTS = {
    "small": (SMALL, 2, 2),
    "pp": (WITH_PP, 2, 4),
    "interleaved": (WITH_VPP, 2, 4),
    "moe": (MOE, 4, 2),
}


def reference_of(layout) -> str:
    return next(name for name, (flags, _, _) in REFERENCE_LAYOUTS.items() if flags is layout)


def launch(tmp, layout, nodes, spares, per_node, faults, extra=(), env=None):
    return launch_deadpool(
        tmp, layout + list(extra), nodes, spares, per_node, faults, ITERS, env=env
    )


@pytest.fixture(scope="module")
def corpus(corpus_prefix):
    os.environ["HOT_SWAP_CORPUS"] = corpus_prefix
    return corpus_prefix


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus):
    """Failure-free runs through the same launcher, one per layout."""
    base = tmp_path_factory.mktemp("reference")
    out = {}
    for name, (layout, nodes, per_node) in REFERENCE_LAYOUTS.items():
        must_succeed(launch(base / name, layout, nodes, 0, per_node, []))
        out[name] = base / name
    return out


def failing_gpus_on_node_2(tmp) -> dict:
    """The agents' NVML is tests/common/fake_nvml: node 2's GPUs have
    uncorrectable ECC errors, every other node's are healthy."""
    table = tmp / "nvml.json"
    failing, healthy = [{"ecc_uncorrected": 4}] * 2, [{}] * 2  # a GPU per rank
    table.write_text(json.dumps({"nodes": {"2": failing}, "default": healthy}))
    path = os.path.join(COMMON, "fake_nvml")
    return {"FAKE_NVML": str(table), "PYTHONPATH": path + os.pathsep + worker_env()["PYTHONPATH"]}


# Environment beside the workers' usual one, per scenario (tmp -> variables).
ENVIRONMENTS = {
    **{name: lambda tmp: {FORK_WORKERS_ENV: "0"} for name in STARTED},
    "unhealthy-spare": failing_gpus_on_node_2,
}


@pytest.fixture(scope="module", params=list(SCENARIOS))
def recovered(request, tmp_path_factory, references):
    layout, nodes, spares, per_node, faults = SCENARIOS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    env = ENVIRONMENTS[request.param](tmp) if request.param in ENVIRONMENTS else None
    extra = EXTRA.get(request.param, ())
    result = launch(tmp, layout, nodes, spares, per_node, faults, extra, env=env)
    (tmp / "output.log").write_text(result[0].stdout + result[0].stderr)
    must_succeed(result)
    reference = references[reference_of(layout)]
    return request.param, tmp, reference


def test_curve_equals_the_failure_free_run_bit_for_bit(recovered):
    name, tmp, reference = recovered
    got, want = read_metrics(tmp / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert [m["iteration"] for m in got] == list(range(1, ITERS + 1))
    assert curve(got) == curve(want)
    if name.startswith("moe"):  # the routers' losses are part of the curve
        assert all("load_balancing_loss" in m for m in got + want)


def test_final_state_of_every_rank_equals_the_failure_free_run(recovered):
    name, tmp, reference = recovered
    got, want = checkpoint_state(str(tmp / "ckpt")), checkpoint_state(str(reference / "ckpt"))
    assert saved_args(str(tmp / "ckpt")).world_size in (4, 8)
    assert_same_state(got, want)


def test_events_tell_the_recovery(recovered):
    name, tmp, _ = recovered
    events = read_events(str(tmp / "events.jsonl"))
    kinds = [e["event"] for e in events]
    # One recovery per failure, except a failure during a recovery, which
    # that recovery absorbs (a stuck rank's kill among them).
    # (A flipped mirror copy is sent again whole: nothing to recover.)
    faults = [
        f for f in SCENARIOS[name][4] if not f.startswith("disk-full") and "target=mirror" not in f
    ]
    during = sum(
        "phase=recovery" in f or (f.startswith("stall") and name.endswith("stuck")) for f in faults
    )
    assert kinds.count("recovered") == len(faults) - during
    assert kinds.count("failure_detected") >= len(faults)
    for e in events:
        assert {"time", "rank", "event"} <= e.keys()
    for kind in (
        "failure_detected",
        "decision",
        "groups_rebuilt",
        "state_restored",
        "first_iteration_after_recovery",
    ):
        assert kind in kinds, kind
    # Every rank takes part in creating every group of a generation; what it
    # holds and connects to is its own.
    for gen in {e["gen"] for e in events if e["event"] == "groups_rebuilt"}:
        rebuilt = [e for e in events if e["event"] == "groups_rebuilt" and e["gen"] == gen]
        assert len({e["groups_created"] for e in rebuilt}) == 1, rebuilt
        assert all(
            0 < e["groups_held"] <= e["groups_created"] + e["groups_kept"] for e in rebuilt
        ), rebuilt
        assert all(e["connections"] > 0 for e in rebuilt), rebuilt
    rebuilt = [e for e in events if e["event"] == "groups_rebuilt"]
    if name == "keep-pp-node":
        # Node 0's ranks (replica 0) keep their tensor-parallel groups and
        # the like, each but one its heartbeat thread released whole: that
        # one was blocked in a group that could have been kept (a peer
        # stopped before the collective it was in, as where the kill caught
        # the peer's mirror exchange). Every survivor's single-rank groups
        # are kept with the rest, so a rank with any group intact keeps some.
        # The first survivor to stop was blocked by nobody. The spares, in
        # node 1's place, keep none.
        torn_down = {e["rank"]: e for e in events if e["event"] == "groups_torn_down"}
        assert any(torn_down[rank]["groups_intact"] > 0 for rank in range(4)), torn_down
        for e in rebuilt:
            intact = e["rank"] < 4 and torn_down[e["rank"]]["groups_intact"] > 0
            assert (e["groups_kept"] > 0) == intact, (e, torn_down.get(e["rank"]))
    if not name.startswith("keep-"):  # by default every group is made again
        assert all(e["groups_kept"] == 0 for e in rebuilt), rebuilt
    restored = [e for e in events if e["event"] == "state_restored"]
    if name == "nan":  # a rollback: every rank from its own snapshot
        assert {e["source"] for e in restored} == {"own"} and len(restored) == 4
        nan = [e for e in events if e["event"] in ("nan_detected", "nan_transient")]
        assert [(e["event"], e["rank"], e["iteration"]) for e in nan] == [
            ("nan_detected", 1, 4),
            ("nan_transient", 1, 4),
        ]
    else:
        assert any(e["source"] == "buddy" for e in restored)
    # Only the interrupted iteration is redone: training restarts at the
    # start of the iteration the last fault hit (iterations count from 1).
    # A kill inside the mirror exchange redoes the iteration before it too,
    # and so may a node killed in backward (its other ranks may still be
    # sending); at an iteration start the whole node waits for its exchanges.
    earliest = latest = None
    for e in sorted(events, key=lambda e: e["time"]):
        if e["event"] == "fault_injected" and e["action"] == "disk-full":
            continue
        if e["event"] == "fault_injected" and e.get("target") == "mirror":
            continue
        if e["event"] == "fault_injected" and e["iteration"] is not None:
            latest = e["iteration"] - (2 if e["phase"] == "mirror" else 1)
            earliest = latest - (e["node"] is not None and e["phase"] == "backward")
        if e["event"] == "state_restored":
            assert earliest <= e["rollback_to"] <= latest, e
    detected = [e for e in events if e["event"] == "failure_detected"]
    if name == "hang":
        assert "hung" in detected[0]["reason"]
    if name == "unhealthy-spare":
        health = [e for e in events if e["event"] == "gpu_health"]
        assert {e["slot"] for e in health if e["problems"]} == {"2.0", "2.1"}, health
        healthy = {e["slot"] for e in health if not e["problems"]}
        assert healthy == {"0.0", "0.1", "1.0", "1.1", "3.0", "3.1"}
        withheld = [e["slot"] for e in events if e["event"] == "spare_withheld"]
        assert sorted(withheld) == ["2.0", "2.1"]
        decision = next(e for e in events if e["event"] == "decision")
        assert decision["replaced"] == {"2": "3.0", "3": "3.1"}
        assert decision["withheld"] == ["2.0", "2.1"]
        assert sorted(decision["gpus"]) == ["3.0", "3.1"]
        assert all(g.endswith("healthy") for g in decision["gpus"].values())
    if name == "oom":
        assert detected[0]["ranks"] == [2] and "code 7 (LOCAL_FAILURE)" in detected[0]["reason"]
    if name == "flips":
        caught = [e for e in events if e["event"] == "sdc_detected"]
        assert [(e["check"], e["iteration"], e["suspects"], e["action"]) for e in caught] == [
            ("weight-hash", 3, [1, 3], "rollback"),
            ("mirror-copy", 3, [3], "resync"),
            ("mirror-replay", 4, [2], "rollback"),
            ("mirror-replay", 6, [2], "swap"),
        ]
        resolved = [e for e in events if e["event"] == "sdc_resolved"]
        assert [(e["iteration"], e["blamed"]) for e in resolved] == [(4, 2)]
        assert [e["ranks"] for e in detected] == [[], [], [2]]
    if name == "stall":
        assert "no progress for 6 s while computing" in detected[0]["reason"]
        assert detected[0]["ranks"] == [1]
    if name.endswith("stuck"):
        # Rank 1 wrote where it was blocked before the coordinator killed it.
        stuck = [e for e in events if e["event"] == "stuck"]
        assert [e["rank"] for e in stuck] == [1] and "inject.py" in stuck[0]["stacks"]
        assert detected[0]["ranks"] == [2] and detected[1]["ranks"] == [1]
        assert "stuck" in detected[1]["reason"]
        assert stuck[0]["time"] < detected[1]["time"]


def test_tensorboard_shows_the_recovered_curve_and_each_recovery(recovered):
    """One 'lm loss' point per iteration, the recovered run's (the redone
    iterations purged), and each recovery at the first iteration after it."""
    name, tmp, _ = recovered
    scalars = tensorboard_scalars(str(tmp / "tb"))
    got = read_metrics(tmp / "metrics.jsonl")
    # disk-full: rank 3, the last rank, may write iteration 2's events while
    # its disk is full; those are lost, and nothing else.
    lost = {2} if name == "disk-full" else set()
    written = [(m["iteration"], float32(m["lm_loss"])) for m in got]
    assert set(written) - set(scalars["lm loss"]) <= {w for w in written if w[0] in lost}
    assert set(scalars["lm loss"]) <= set(written)
    steps = [s for s, _ in scalars["lm loss"]]
    assert steps == sorted(set(steps))  # each iteration once
    events = read_events(str(tmp / "events.jsonl"))
    generations = [e["gen"] for e in events if e["event"] == "recovered"]
    assert [v for _, v in scalars["deadpool/generation"]] == generations
    steps = [s for s, _ in scalars["deadpool/generation"]]
    assert [s for s, _ in scalars["deadpool/data-parallel-size"]] == steps
    assert all(v > 0 for _, v in scalars["deadpool/first-iteration-seconds"])
    assert all(v > 0 for _, v in scalars["deadpool/restore-ms"])
    if name == "unhealthy-spare":  # the spares left out for their GPUs
        assert [v for _, v in scalars["deadpool/spares-withheld"]] == [2]
    if name == "flips":  # each recovery's line names the check and the suspects
        lines = tensorboard_texts(str(tmp / "tb"), "deadpool/recovery")
        assert len(lines) == 3, lines
        assert "weight-hash check, iteration 3, suspect rank(s) 1, 3" in lines[0]
        assert "mirror-replay check, iteration 4, suspect rank(s) 2" in lines[1]
        assert "rank 2 is replaced as a failing node" in lines[2]


def test_saves_that_fail_or_die_stop_nothing(recovered):
    """A save that cannot be written is reported on every rank, the tracker
    keeps naming the checkpoint before, no half-written directory is left,
    and training goes on (its curve and final state are checked above). A
    save whose rank dies is redone after the recovery."""
    name, tmp, _ = recovered
    if "--save-interval" not in EXTRA.get(name, ()):
        pytest.skip("no interval saves in this scenario")
    ckpt, log = tmp / "ckpt", (tmp / "output.log").read_text()
    assert read_tracker(str(ckpt)) == "8"
    retained = name in ("disk-full", "save-kill")  # 2 failed there; retention here
    saved = [f"iter_{i:07d}" for i in ((4, 8) if retained else (2, 4, 6, 8))]
    assert sorted(os.listdir(ckpt)) == saved + ["latest_checkpointed_iteration.txt"]
    if name == "disk-full":
        for iteration, rank, before in ((2, 3, "none"), (6, 0, "iteration 4")):
            said = re.findall(
                rf"checkpoint of iteration {iteration} NOT saved \(rank {rank}: "
                rf"[^;]*\); the latest checkpoint in \S+ stays "
                rf"{before}; training goes on",
                log,
            )
            assert len(said) == 4, log[-3000:]  # every rank


@pytest.mark.parametrize(
    "fault",
    ["kill:node=0:iter=4:phase=backward", "kill-launcher:node=0:iter=4"],
    ids=["node", "launcher"],
)
def test_the_coordinator_is_lost_and_the_standby_takes_over_bit_for_bit(
    tmp_path, references, fault
):
    """One launcher per node (as on a cluster). node: node 0 (the store, the
    coordinator and ranks 0-1) dies in backward of iteration 4; node 1's
    standby, which holds the coordinator's state, takes over once node 0's
    lease is silent and node 2 came over, node 2's spares take ranks 0-1
    from their buddies. launcher: node 0's launcher alone dies; its agent
    comes over too, and training goes on in the same generation, nothing
    redone. Either way the job ends as the failure-free one."""
    args = deadpool_args(tmp_path, SMALL, [fault], ITERS)
    codes = launch_on_nodes(tmp_path, args, nodes=2, spares=1, per_node=2)
    logs = "".join((tmp_path / f"node{n}.log").read_text() for n in range(3))
    assert codes == [-9, 0, 0], readable_logs(tmp_path, 3)
    assert not leftovers(tmp_path)
    assert_same_run(tmp_path, references["small"], ITERS)
    events = read_events(str(tmp_path / "events.jsonl"))
    takeover = [e for e in events if e["event"] == "takeover"]
    assert len(takeover) == 1 and takeover[0]["node"] == 0, takeover
    assert "node 1 takes over" in logs
    detected = [e for e in events if e["event"] == "failure_detected"]
    if fault.startswith("kill-launcher"):
        assert takeover[0]["alive"] and not detected
        assert not [e for e in events if e["event"] == "state_restored"]
        return
    assert detected[-1]["ranks"] == [0, 1] and "coordinator's node" in detected[-1]["reason"]
    decisions = [e for e in events if e["event"] == "decision"]
    assert decisions[-1]["replaced"] == {"0": "2.0", "1": "2.1"}


@pytest.mark.parametrize("timeouts", [2, 5], ids=["2x-timeout", "5x-timeout"])
def test_a_paused_coordinator_declares_nobody_lost_bit_for_bit(tmp_path, references, timeouts):
    """The launcher (store and coordinator) is stopped (SIGSTOP) in iteration
    3 for 2x and 5x the 4 s heartbeat timeout while agents and workers go
    on as far as they can without the store. On waking it knows the time
    was its own, not its peers' silence: nobody is declared lost and the
    job ends as the failure-free one. (Without that, every node is declared
    lost on waking and the job aborts.)"""
    pause = 4 * timeouts
    fault = f"pause-launcher:rank=0:iter=3:seconds={pause}"
    extra = ["--deadpool-heartbeat-timeout", "4"]
    proc, left = launch(tmp_path, SMALL, 2, 1, 2, [fault], extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not left, f"processes left behind: {left}"
    assert_same_run(tmp_path, references["small"], ITERS)
    events = read_events(str(tmp_path / "events.jsonl"))
    assert not [e for e in events if e["event"] in ("failure_detected", "decision")]
    paused = [e["seconds"] for e in events if e["event"] == "coordinator_paused"]
    assert len(paused) == 1 and pause - 1 <= paused[0] <= pause + 5, paused


@pytest.mark.parametrize(
    "faults,spares,reason",
    [
        # (The default policy would shrink instead: tests/functional_tests/test_shrink.py.)
        (["kill:rank=1:iter=3"], 0, "spares exhausted"),
        # With DP=2 ranks 0 and 2 are each other's buddy (and on different nodes).
        (["kill:rank=0:iter=3", "kill:rank=2:iter=3"], 1, "were both lost"),
        # A NaN each time iteration 3 runs: rolled back once, then the job stops.
        (["nan-always:rank=1:iter=3"], 1, "found a NaN or Inf again in iteration 3"),
        # Replicas 1 and 3 disagree twice: with two replicas nobody can tell
        # which of them holds the bad copy, so none is kept silently.
        (
            ["flip:rank=1:iter=2:target=param", "flip:rank=3:iter=4:target=param"],
            1,
            "cannot tell which of the ranks holds the bad copy",
        ),
    ],
    ids=["spares-exhausted", "rank-and-buddy-lost", "persistent-nan", "corruption-twice"],
)
def test_unrecoverable_failures_stop_the_job_clearly(tmp_path, corpus, faults, spares, reason):
    proc, left = launch(
        tmp_path, SMALL, 2, spares, 2, faults, extra=["--deadpool-on-spares-exhausted", "abort"]
    )
    assert proc.returncode != 0
    assert reason in proc.stderr, proc.stderr[-3000:]
    assert not left, f"processes left behind: {left}"
    events = read_events(str(tmp_path / "events.jsonl"))
    assert [e for e in events if e["event"] == "abort" and reason in e["reason"]]
    assert any(e["event"] == "stopping" for e in events)
