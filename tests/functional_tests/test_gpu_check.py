"""The prepared GPU validation's script (tools/gpu_check.sh), run here as
a process in its dry run: the script a GPU session's device call runs.
(The dry run and checks of tools/gpu_check.py, in-process, are unit tests:
tests/unit_tests/tools/test_gpu_check.py.)"""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_the_script_a_gpu_session_runs_dry_runs_here(tmp_path):
    """``bash tools/gpu_check.sh OUT --dry-run``: the device call's script,
    its wheel install left out."""
    from dist_utils import REPO, worker_env

    proc = subprocess.run(
        ["bash", "tools/gpu_check.sh", str(tmp_path / "out"), "--dry-run"],
        cwd=REPO,
        env=dict(worker_env(), PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(": ok") == 13
