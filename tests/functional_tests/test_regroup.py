"""What re-pointing process groups by identity would rest on, held to the
installed torch in real processes: a gloo group outlives its default group."""

import sys

import pytest

from dist_utils import captured

pytestmark = pytest.mark.integration


def test_torch_lets_a_gloo_group_outlive_its_default_group():
    """What a partial rebuild would rest on (docs/scale.md section 3), held
    to the installed torch: rank 2 of 4 replaced by a new process, the
    groups without it kept and registered in the next generation's world,
    the others made again, and gloo's per-group sequence numbers equal
    after matching operations and unequal after an unreceived send."""
    run = captured(
        [sys.executable, "-m", "tools.probes.keep_groups", "--ranks", "4", "--replace", "2"],
        timeout=240,
    )
    assert run.returncode == 0 and "kept groups work" in run.stdout, run.stdout + run.stderr
    assert "rank 0: kept [(0, 1)], made again []" in run.stdout
    assert "rank 2 (new): kept [], made again [(1, 2), (2, 3)]" in run.stdout
