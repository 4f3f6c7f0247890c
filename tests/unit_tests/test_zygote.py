"""Workers forked from a node's zygote (deadpool_ext/control/zygote.py) are
the command's processes as if started with it: their environment, arguments,
command line (what ps, pgrep and the fault campaign read), exit codes and
signals; and none outlives the zygote. (Every deadpool-launch test on this
machine forks its workers so; test_hot_swap.py's 'hang' scenario starts
them from the command instead, as on a GPU node.)"""

import json
import os
import signal
import sys
import time

import pytest

from dist_utils import REPO
from deadpool_ext.control.zygote import ForkedWorker, Zygote

pytestmark = pytest.mark.integration

SCRIPT = """
import json, os, sys, time
with open(os.environ["OUT"], "w") as f:
    json.dump({"argv": sys.argv, "env": dict(os.environ), "path0": sys.path[0],
               "cmdline": open("/proc/self/cmdline", "rb").read().decode(),
               "parent": os.getppid()}, f)
if os.environ["CODE"] == "sleep":
    time.sleep(120)
sys.exit(int(os.environ["CODE"]))
"""


def wait_for_end(worker: ForkedWorker, timeout_s: float = 60) -> int:
    deadline = time.monotonic() + timeout_s
    while worker.poll() is None:
        assert time.monotonic() < deadline, "the worker did not end"
        time.sleep(0.05)
    return worker.returncode


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def zygote(tmp_path, monkeypatch):
    """A zygote for ``python -u script.py --some flags``."""
    monkeypatch.setenv("PYTHONPATH", REPO)
    (tmp_path / "script.py").write_text(SCRIPT)
    command = [sys.executable, "-u", str(tmp_path / "script.py"), "--some", "flags"]
    made = Zygote(command)
    yield made, command
    made.close()


def spawn(zygote: Zygote, out, code, calls=None) -> ForkedWorker:
    env = dict(os.environ, OUT=str(out), CODE=str(code))
    return zygote.spawn(env, while_waiting=lambda: calls.append(1) if calls is not None else None)


def test_a_forked_worker_is_its_command_with_its_environment(tmp_path, zygote):
    made, command = zygote
    calls = []
    for name, code in (("a", 7), ("b", 0)):
        worker = spawn(made, tmp_path / f"{name}.json", code, calls)
        assert wait_for_end(worker) == code
        seen = json.loads((tmp_path / f"{name}.json").read_text())
        assert seen["env"]["OUT"] == str(tmp_path / f"{name}.json")
        assert "DEADPOOL_ZYGOTE_FD" not in seen["env"]
        assert seen["argv"] == command[2:]
        assert seen["cmdline"].rstrip("\0").split("\0") == command
        assert seen["path0"] == str(tmp_path)  # as `python script.py`
        assert seen["parent"] == made.process.pid
    # The first answer waits for the zygote's imports; the agent beats meanwhile.
    assert calls
    with open(f"/proc/{made.process.pid}/cmdline", "rb") as f:
        own = f.read().rstrip(b"\0").split(b"\0")
    assert own[-3:-1] == [b"-m", b"deadpool_ext.control.zygote"]
    assert json.loads(own[-1]) == command  # the command as one argument


def test_signals_reach_a_forked_worker_and_none_outlives_the_zygote(tmp_path, zygote):
    made, _ = zygote
    killed = spawn(made, tmp_path / "killed.json", "sleep")
    left = spawn(made, tmp_path / "left.json", "sleep")
    deadline = time.monotonic() + 60
    while not (tmp_path / "left.json").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    killed.kill()
    assert wait_for_end(killed) == -signal.SIGKILL
    assert left.poll() is None
    made.close()
    deadline = time.monotonic() + 10
    while alive(left.pid):  # the parent-death signal
        assert time.monotonic() < deadline, "a worker outlived its zygote"
        time.sleep(0.05)
