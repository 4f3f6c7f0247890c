"""forkrun.py, the tests' torchrun with forked ranks, stands in for torchrun:
the same training bit for bit, the same variables for a rank, and a job
that ends when one rank fails."""

import json

import pytest

from dist_utils import (
    TINY_GPT,
    assert_same_state,
    checkpoint_state,
    curve,
    forkrun,
    leftovers,
    read_metrics,
    torchrun,
)

pytestmark = pytest.mark.integration

# The variables forkrun sets; torchrun gives them the same values, but a port.
RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
)


def training_args(directory, corpus) -> list:
    return TINY_GPT + [
        "--tensor-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--global-batch-size",
        "8",
        "--train-iters",
        "3",
        "--data-path",
        corpus,
        "--save",
        str(directory / "ckpt"),
        "--metrics-file",
        str(directory / "metrics.jsonl"),
    ]


def test_forked_ranks_train_as_torchruns_ranks_do(tmp_path, corpus_prefix):
    runs = {}
    for name, run in (("torchrun", torchrun), ("forkrun", forkrun)):
        directory = tmp_path / name
        proc = run(4, training_args(directory, corpus_prefix))
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = directory
    forked, started = (read_metrics(runs[n] / "metrics.jsonl") for n in ("forkrun", "torchrun"))
    assert len(forked) == 3 and curve(forked) == curve(started)
    assert_same_state(
        checkpoint_state(str(runs["torchrun"] / "ckpt")),
        checkpoint_state(str(runs["forkrun"] / "ckpt")),
    )


def test_a_rank_has_the_variables_torchrun_gives_it(tmp_path):
    script = tmp_path / "show_variables.py"
    # One write per rank, line and newline together: the ranks share the
    # pipe, and two writes each could interleave (unbuffered under -u).
    script.write_text(
        "import json, os, sys\n"
        f"names = {RANK_VARIABLES!r}\n"
        "sys.stdout.write(json.dumps({n: os.environ.get(n) for n in names}) + '\\n')\n"
        "sys.stdout.flush()\n"
    )
    seen = {}
    for name, run in (("torchrun", torchrun), ("forkrun", forkrun)):
        proc = run(2, [], timeout=120, script=str(script))
        assert proc.returncode == 0, proc.stderr[-4000:]
        lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        seen[name] = sorted(lines, key=lambda variables: variables["RANK"])
    assert [v["RANK"] for v in seen["forkrun"]] == ["0", "1"]
    assert seen["forkrun"] == seen["torchrun"]


def test_a_failed_rank_stops_the_others_and_fails_the_job(tmp_path):
    script = tmp_path / "one_fails.py"
    script.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(600)\n"
    )
    proc = forkrun(3, [], timeout=60, script=str(script))
    assert proc.returncode == 1
    assert "forkrun: rank 1 exited with 3" in proc.stderr
    assert not leftovers(tmp_path), "a rank outlived its job"
