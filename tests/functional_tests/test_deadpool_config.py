"""--deadpool flags refused by real processes: pretrain_gpt.py refuses a bad
layout before any process group (from argument parsing, so no rendezvous
is attempted), and the launcher refuses a multi-node run without a shared
secret or timeouts out of their order, and says why its workers refused
their flags. (The flags' checks, in-process, are in
tests/unit_tests/test_config.py.)"""

import os
import sys

import pytest

from dist_utils import captured, worker_env
from tests.unit_tests.test_config import BASE, DEADPOOL, FLAG_ORDERS, TP2_PP2

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pretrain_gpt_refuses_before_any_process_group():
    """One process standing in for rank 0 of an 8-rank single-node torchrun:
    the error comes from argument parsing, so no rendezvous is attempted."""
    env = dict(
        worker_env(),
        WORLD_SIZE="8",
        LOCAL_WORLD_SIZE="8",
        RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
        PYTHONWARNINGS="ignore",
    )
    proc = captured(
        [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *BASE, *DEADPOOL, *TP2_PP2],
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pretrain_gpt.py: error: --deadpool found no buddy on another node" in proc.stderr


def test_the_launcher_refuses_a_multi_node_run_without_a_shared_secret():
    env = {k: v for k, v in worker_env().items() if k != "DEADPOOL_SECRET"}
    proc = captured(
        [
            sys.executable,
            "-m",
            "deadpool_ext.launch",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            "29500",
            "pretrain_gpt.py",
        ],
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2 and "DEADPOOL_SECRET" in proc.stderr


@pytest.mark.parametrize("flags, broken, fix", FLAG_ORDERS, ids=["stuck", "interval", "mirror"])
def test_the_launcher_refuses_timeouts_out_of_order_before_any_worker(flags, broken, fix):
    from dist_utils import launch_command

    launcher = ["--standalone", "--nnodes", "2", "--spare-nodes", "1", "--nproc-per-node", "2"]
    proc = captured(launch_command(launcher, BASE + DEADPOOL + flags), timeout=120)
    said = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(said) == 1, proc.stderr[-2000:]
    assert said[0].startswith(f"deadpool-launch: error: {broken}") and fix in said[0], said


@pytest.mark.parametrize(
    "bad, says",
    [
        (["--no-such-flag"], "unknown flag --no-such-flag"),
        (
            ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
            "--num-layers 3 does not split evenly",
        ),
    ],
)
def test_the_launcher_says_why_the_workers_refused_their_flags(bad, says):
    """Every worker refuses the same flags: the job stops at once, saying
    what the workers said (not a missing buddy plan after a timeout)."""
    from dist_utils import TINY_GPT, launch_command

    args = TINY_GPT + DEADPOOL + ["--mock-data", "--train-iters", "2"] + bad
    launcher = ["--standalone", "--nnodes", "2", "--spare-nodes", "1", "--nproc-per-node", "2"]
    proc = captured(launch_command(launcher, args), timeout=120)
    assert proc.returncode != 0
    stopped = [line for line in proc.stderr.splitlines() if "job stopped" in line]
    assert len(stopped) == 1 and "refused its flags" in stopped[0] and says in stopped[0]
