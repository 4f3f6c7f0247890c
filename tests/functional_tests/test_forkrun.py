"""forkrun.py, the tests' torchrun with forked ranks, stands in for torchrun:
the same training bit for bit, the same variables for a rank, and a job
that ends when one rank fails. forkserver.py, which forks the tests' Python
commands, stands in for starting them."""

import json
import os
import subprocess
import sys

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


# What a command's process reports of itself, then its exit.
SELF_REPORT = """
import json, os, signal, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
                  "env": os.environ.get("CHECK"), "module": __name__,
                  "cmdline": open("/proc/self/cmdline", "rb").read().decode().rstrip(chr(0)),
                  "session": os.getsid(0) == os.getpid(), "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
if os.environ.get("CHECK") == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
sys.exit(3)
"""


@pytest.mark.parametrize("check", ["exit", "signal"])
def test_a_served_command_is_the_started_one(tmp_path, check):
    import forkserver
    from dist_utils import REPO, worker_env

    (tmp_path / "report.py").write_text(SELF_REPORT)
    command = [sys.executable, "-u", str(tmp_path / "report.py"), "--a", "b"]
    env = dict(worker_env(), CHECK=check)
    started = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    served = forkserver.run(command, env, str(tmp_path), timeout=60)
    assert forkserver.SERVER.process is not None  # it was served, not started
    assert (served.returncode, served.stderr) == (started.returncode, started.stderr)
    assert served.returncode == (3 if check == "exit" else -15)
    assert json.loads(served.stdout) == json.loads(started.stdout)
    assert json.loads(served.stdout)["cmdline"].split("\0") == command
    # The same code given with -c.
    inline = [sys.executable, "-c", SELF_REPORT, "--a", "b"]
    started = subprocess.run(inline, env=env, cwd=tmp_path, capture_output=True, text=True)
    served = forkserver.run(inline, env, str(tmp_path), timeout=60)
    assert (served.returncode, served.stderr) == (started.returncode, started.stderr)
    assert json.loads(served.stdout) == json.loads(started.stdout)
    # A command that other interpreter options start is started as a process.
    assert forkserver.start([sys.executable, "-X", "dev", "x.py"], env, REPO, 1, 2) is None
    assert forkserver.start(command, dict(env, PYTHONPATH="x"), REPO, 1, 2) is None


def test_a_served_command_in_its_own_session(tmp_path):
    import forkserver

    from dist_utils import worker_env

    (tmp_path / "report.py").write_text(SELF_REPORT)
    command = [sys.executable, "-u", str(tmp_path / "report.py")]
    with open(tmp_path / "out", "w") as out:
        process = forkserver.start(
            command, worker_env(), str(tmp_path), out.fileno(), out.fileno(), True
        )
        assert process.wait(timeout=60) == 3
    report = json.loads((tmp_path / "out").read_text().splitlines()[0])
    assert report["session"] and report["stdin"] == "" and report["module"] == "__main__"
    assert not os.path.exists(f"/proc/{process.pid}")
