"""Tests for megatron/training/arguments.py (and its checks, flags/) run
through pretrain_gpt.py as a process: it fails fast on bad arguments,
before any process group (no rendezvous is attempted), and its --help lists
every flag. (The arguments' defaults, generated flags and bad inputs,
in-process, are in tests/unit_tests/training/test_arguments.py and
tests/unit_tests/training/flags/.)
"""

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.unit_tests.training.command_line import _names_all, argv

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- pretrain_gpt.py -----------------------------------------------------------------


def test_pretrain_gpt_fails_fast_before_any_process_group():
    # A port we hold, listening but never accepting: a process group would
    # connect to it (rank 1 is a store client) and then hang.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        WORLD_SIZE="3",
        RANK="1",
        LOCAL_RANK="1",
        LOCAL_WORLD_SIZE="3",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                os.path.join(REPO, "pretrain_gpt.py"),
                *argv("--tensor-model-parallel-size", "2"),
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - start
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected to MASTER_PORT
    finally:
        listener.close()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pretrain_gpt.py: error:" in proc.stderr
    _names_all(
        proc.stderr,
        "world size 3",
        "--tensor-model-parallel-size",
        "--pipeline-model-parallel-size",
    )
    assert "Traceback" not in proc.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s to reject the arguments"


def test_help_lists_every_flag():
    import subprocess
    import sys

    from dist_utils import REPO, worker_env

    proc = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--help"],
        cwd=REPO,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--exit-interval" in proc.stdout and "--deadpool-spare-wait" in proc.stdout
