"""Recovery that cannot hang, with real processes (tools/chaos.py).

First the runs that once ended the job instead of recovering (two 4-rank
nodes, Megatron's default data-loader workers, whose forked processes hold
every socket of the groups): each must now finish with the failure-free
run's curve, bit for bit where a hot swap recovers it, within the shrink
tolerance where the job shrinks, and every survivor must have torn its
groups down within the heartbeat timeout of the failure's detection.
Then a short seeded sample of the randomized campaign (the full campaign,
100 trials, is run by hand: docs/reliability.md). The campaign's draws,
in-process, are tested in tests/unit_tests/tools/test_chaos.py.
"""

import dataclasses
import os

import pytest

import forkserver
from tools.compare import read_metrics, shrink_difference
from dist_utils import REPO
from tools import chaos

pytestmark = pytest.mark.integration

ISSUE = dict(model="issue", iteration=4, phase="forward", delay_ms=0)
# TP2·PP2·DP2, no spare, rank 5 killed: the job shrinks to DP1. With
# Megatron-LM's dropout (0.1), whose masks follow the sample
# (--deadpool-sample-rng): every sample and lr the failure-free run's, loss
# and grad norm within the shrink tolerance at every iteration.
SHRINK = chaos.Trial(0, 0, 2, 2, 0, target="rank", victim=5, **ISSUE)
RUNS = {
    "shrink-as-written": SHRINK,
    # A spare node still warming up when node 1 dies: wait for it and swap once.
    "warming-spares": chaos.Trial(0, 0, 2, 2, 1, target="node", victim=1, **ISSUE),
    # The same with no wait: shrink, then grow back as soon as the spares are
    # ready. The spares are held warming until the shrunk job trains
    # (generation 1), so that node 1's loss at iteration 2 finds them
    # warming whatever the machine's speed; the run is long enough for them
    # to be ready after (about 1.4 s after the shrink, when 40 iterations
    # take about 20 s).
    "shrink-then-grow": chaos.Trial(
        0,
        0,
        2,
        2,
        1,
        target="node",
        victim=1,
        spare_wait=0.0,
        expect="shrink",
        iters=40,
        model="issue",
        iteration=2,
        phase="forward",
        delay_ms=0,
        spares_ready_gen=1,
    ),
    # An 8-rank pipeline, a rank killed 30 ms into its backward; the buddies
    # replay gradients (--deadpool-mirror-mode grad).
    "pipeline-backward": chaos.Trial(
        0,
        0,
        1,
        4,
        1,
        target="rank",
        victim=6,
        model="issue",
        iteration=5,
        phase="backward",
        delay_ms=30,
        mirror_mode="grad",
    ),
    # The interleaved schedule (PP2, two virtual stages) at DP 4, 2
    # microbatches per replica, no spare: rank 3 is lost and DP 3 would
    # give a replica 3 (a group of 2 and 1 left over), so the job shrinks
    # to DP 2. The buddies replay gradients.
    "interleaved-shrink": chaos.Trial(
        0,
        0,
        1,
        2,
        0,
        target="rank",
        victim=3,
        model="tiny",
        iteration=4,
        phase="backward",
        delay_ms=0,
        virtual_stages=2,
        mirror_mode="grad",
    ),
}


# The coordinator's decisions each run must show (what makes it the case it is).
EXPECTED_ACTIONS = {
    "shrink-as-written": ["shrink"],
    "warming-spares": ["recover"],
    "shrink-then-grow": ["shrink", "grow"],
    "pipeline-backward": ["recover"],
    "interleaved-shrink": ["shrink"],
}
# The data-parallel size each shrink leaves.
SHRUNK_TO = {"shrink-as-written": 1, "interleaved-shrink": 2}


@pytest.fixture(autouse=True)
def launchers_from_the_fork_server(monkeypatch):
    """The campaign's launchers forked from the session's fork server (as
    dist_utils' are), where it can fork them."""
    monkeypatch.setattr(
        chaos,
        "start_launcher",
        lambda command, env, log: forkserver.start_logged(command, env, REPO, log),
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("chaos"))


@pytest.mark.parametrize("name", list(RUNS))
def test_the_runs_that_once_hung_recover(name, workdir):
    trial = RUNS[name]
    result = chaos.run_trial(
        dataclasses.replace(trial, index=list(RUNS).index(name)), workdir, limit_s=400
    )
    assert result["passed"], f"{trial.describe()}: {result['problem']} ({result['folder']})"
    events = chaos.read_jsonl(os.path.join(result["folder"], "events.jsonl"))
    decisions = [e for e in events if e["event"] == "decision"]
    assert [e["action"] for e in decisions] == EXPECTED_ACTIONS[name], decisions
    if name in SHRUNK_TO:
        assert decisions[0]["dp_after"] == SHRUNK_TO[name], decisions[0]


def test_without_sample_keyed_draws_the_shrink_drifts(workdir):
    """Negative control of shrink-as-written: dropout drawn from each rank's
    stream (--no-deadpool-sample-rng, Megatron-LM's way) gives the moved
    microbatches other masks, and the curve leaves the shrink tolerance from
    the fault on (1e-4 to 1e-3 relative, against 1e-7 with them keyed)."""
    trial = dataclasses.replace(SHRINK, index=len(RUNS), sample_rng=False)
    result = chaos.run_trial(trial, workdir, limit_s=400)
    assert result["passed"], f"{trial.describe()}: {result['problem']} ({result['folder']})"
    got = read_metrics(os.path.join(result["folder"], "metrics.jsonl"))
    want = read_metrics(os.path.join(chaos.reference(trial, workdir, 400), "metrics.jsonl"))
    drift = shrink_difference(got, want, trial.iteration)
    assert drift is not None and drift.startswith(f"iteration {trial.iteration}:"), drift


def test_a_seeded_sample_of_the_fault_campaign(workdir, capsys):
    """The campaign's command line, in this process (its launchers then come
    from the fork server). Seed 1675 draws a hot swap, a stop and a shrink,
    of tiny models; the shrink shares its failure-free run with
    interleaved-shrink's above (the workdir is the module's)."""
    code = chaos.main(["--trials", "3", "--seed", "1675", "--workdir", workdir])
    out = capsys.readouterr().out
    assert code == 0, out[-4000:]
    assert "3 passed, 0 failed" in out
