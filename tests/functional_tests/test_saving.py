"""A save whose local write fails on one rank, at any step, is reported
as failed on every rank without a hang; the tracker keeps naming the save
before, no staged directory is left, and the next save succeeds. Real
processes (forkrun.py, gloo) and real write errors (a full disk: the rank's
file size limit at 0) where the step writes a file."""

import json
import os

import pytest

from dist_utils import REPO, forkrun

pytestmark = pytest.mark.integration

WORKER = os.path.join(REPO, "tests", "common", "save_worker.py")
# step: the rank whose write fails there
STEPS = {
    "common": 0,
    "shards": 1,
    "metadata": 0,
    "fsync": 1,
    "config": 0,
    "publish": 0,
}


def run(tmp_path, step: str, rank: int, *extra) -> list:
    root, output = tmp_path / "ckpt", tmp_path / "out"
    output.mkdir()
    args = [str(root), step, str(rank), str(output), *extra]
    proc = forkrun(2, args, timeout=120, script=WORKER)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((output / f"rank{r}.json").read_text()) for r in (0, 1)]


CASES = [(step, False) for step in STEPS] + [("shards", True), ("metadata", True)]


@pytest.mark.parametrize(
    "step,background", CASES, ids=[s + ("-async" if b else "") for s, b in CASES]
)
def test_a_failed_write_fails_the_save_on_every_rank_and_nothing_else(tmp_path, step, background):
    rank = STEPS[step]
    ranks = run(tmp_path, step, rank, *(["--async"] if background else []))
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        first, failed, third = r["outcomes"]
        assert (first["errors"], first["latest"]) == ([], "1")
        assert failed["errors"] and all(e.startswith(f"rank {rank}: ") for e in failed["errors"])
        assert failed["latest"] == "1", "the tracker moved to a failed save"
        assert (third["errors"], third["latest"]) == ([], "3")
    assert sorted(os.listdir(tmp_path / "ckpt")) == [
        "iter_0000001",
        "iter_0000003",
        "latest_checkpointed_iteration.txt",
    ]


def test_without_a_failure_every_save_is_named(tmp_path):
    """The negative control: the same run with no step broken."""
    ranks = run(tmp_path, "none", 0)
    for r in ranks:
        assert [o["errors"] for o in r["outcomes"]] == [[], [], []]
        assert [o["latest"] for o in r["outcomes"]] == ["1", "2", "3"]
