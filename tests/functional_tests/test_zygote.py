"""Workers forked from a node's zygote (deadpool_ext/control/zygote.py) are
the command's processes as if started with it: their environment, arguments,
command line (what ps, pgrep and the fault campaign read), exit codes and
signals; and none outlives the zygote, nor the zygote its agent. The zygote
is forked from its agent (``Zygote.fork``), here from zygote_driver.py
standing in for the agent. (Every deadpool-launch test on this machine forks
its workers so; test_hot_swap.py's 'hang' scenario starts them from the
command instead, as on a GPU node.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dist_utils import COMMON, REPO

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
DRIVER = os.path.join(COMMON, "zygote_driver.py")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def drive(tmp_path, scenario: str):
    """The driver's process, the command its zygote forks, and where the
    driver's report will be."""
    (tmp_path / "script.py").write_text(SCRIPT)
    command = [sys.executable, "-u", str(tmp_path / "script.py"), "--some", "flags"]
    report = tmp_path / "report.json"
    driver = subprocess.Popen(
        [sys.executable, DRIVER, scenario, str(report), "--", *command],
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    return driver, command, report


def test_a_forked_worker_is_its_command_with_its_environment(tmp_path):
    driver, command, report = drive(tmp_path, "codes")
    assert driver.wait(timeout=120) == 0
    seen = json.loads(report.read_text())
    assert seen["codes"] == {"a": 7, "b": 0}
    for name in ("a", "b"):
        worker = json.loads((tmp_path / f"{name}.json").read_text())
        assert worker["env"]["OUT"] == str(tmp_path / f"{name}.json")
        assert worker["argv"] == command[2:]
        assert worker["cmdline"].rstrip("\0").split("\0") == command
        assert worker["path0"] == str(tmp_path)  # as `python script.py`
        assert worker["parent"] == seen["zygote"]
    # The first answer waits for the zygote's imports; the agent beats meanwhile.
    assert seen["calls"] > 0
    # ps shows the zygote as the zygote of its command, not as its agent.
    assert seen["cmdline"][-3:-1] == ["-m", "deadpool_ext.control.zygote"]
    assert json.loads(seen["cmdline"][-1]) == command


def test_signals_reach_a_forked_worker_and_none_outlives_the_zygote(tmp_path):
    driver, _, report = drive(tmp_path, "signals")
    assert driver.wait(timeout=120) == 0
    seen = json.loads(report.read_text())
    assert seen["killed"] == -signal.SIGKILL
    assert seen["left_running"]
    # the parent-death signal
    wait_until(lambda: not alive(seen["left"]), 10, "a worker outlived its zygote")


def test_neither_the_zygote_nor_its_workers_outlive_the_agent(tmp_path):
    driver, _, report = drive(tmp_path, "orphan")
    wait_until(report.exists, 120, "the driver did not start its worker")
    seen = json.loads(report.read_text())
    driver.kill()
    driver.wait()
    wait_until(lambda: not alive(seen["zygote"]), 10, "the zygote outlived its agent")
    wait_until(lambda: not alive(seen["worker"]), 10, "a worker outlived its agent")


def children(pid: int) -> list:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]


def command_line(pid: int) -> list:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().decode(errors="replace").rstrip("\0").split("\0")


def test_a_standalone_launcher_forks_each_node_its_agent_and_none_outlives_it(
    tmp_path, corpus_prefix
):
    """--standalone on a CPU: every emulated node's agent is forked from the
    launcher (one import of megatron-core for all), is its node's session
    (a node's kill reaches its agent and workers only), shows the agent's
    command, and dies with the launcher, its workers with it."""
    from dist_utils import TINY_GPT, launch_command, leftovers, worker_env

    args = TINY_GPT + ["--global-batch-size", "4", "--train-iters", "100000", "--data-path"]
    args += [corpus_prefix, "--use-distributed-optimizer", "--deadpool"]
    args += ["--save", str(tmp_path / "ckpt"), "--save-interval", "100000"]
    flags = ["--standalone", "--nnodes", "2", "--spare-nodes", "1", "--nproc-per-node", "1"]
    launcher = subprocess.Popen(launch_command(flags, args), cwd=REPO, env=worker_env())
    try:
        wait_until(
            lambda: (
                len(children(launcher.pid)) == 3
                and all(len(children(agent)) == 1 for agent in children(launcher.pid))
            ),
            120,
            "the launcher did not fork its three agents, each with its zygote",
        )
        agents = children(launcher.pid)
        for agent in agents:
            assert os.getsid(agent) == agent  # its emulated node's session
            assert command_line(agent)[1:3] == ["-m", "deadpool_ext.control.agent"]
        zygotes = [zygote for agent in agents for zygote in children(agent)]
        wait_until(
            lambda: all(len(children(zygote)) == 1 for zygote in zygotes),
            120,
            "the zygotes did not fork one worker each",
        )
        workers = [worker for zygote in zygotes for worker in children(zygote)]
    finally:
        launcher.kill()
        launcher.wait()
    for pid in agents + zygotes + workers:
        wait_until(lambda: not alive(pid), 10, f"process {pid} outlived the launcher")
    assert not leftovers(tmp_path)
