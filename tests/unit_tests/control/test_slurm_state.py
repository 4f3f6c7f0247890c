"""Reading a Slurm node's DRAIN marking (deadpool_ext/control/slurm_state.py),
in-process: scontrol's text is given, never run.

The samples are ``scontrol show node NAME --oneliner`` as Slurm 22.05.8
printed them on tools/slurm_local.sh's cluster (after ``scontrol update
NodeName=X State=DRAIN Reason=...``, with and without a job on the node),
and as newer and older releases print them (src/api/node_info.c).
"""

import subprocess

import pytest

from deadpool_ext.control import slurm_state
from deadpool_ext.control.slurm_state import drain_reason, node_state

HEAD = (
    "NodeName=node2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=4 CPUTot=4 "
    "CPULoad=1.71 AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) "
    "NodeAddr=127.0.0.1 NodeHostName=localhost Port=17002 Version=22.05.8 "
    "OS=Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.76-1 (2024-02-01)  "
    "RealMemory=4000 AllocMem=0 FreeMem=22337 Sockets=4 Boards=1 "
)
TAIL = (
    " ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  "
    "BootTime=2024-05-02T09:48:11 SlurmdStartTime=2024-05-02T10:06:18 "
    "LastBusyTime=2024-05-02T10:06:18 CfgTRES=cpu=4,mem=4000M,billing=4 AllocTRES= "
    "CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 "
    "ExtSensorsTemp=n/s"
)


def oneliner(state: str, reason: str = "") -> str:
    return HEAD + f"State={state}" + TAIL + (f" Reason={reason}" if reason else "") + "\n"


IDLE = oneliner("IDLE")
DRAINED_IDLE = oneliner("IDLE+DRAIN", "maintenance: bad DIMM [root@2024-05-02T10:06:18]")
# A job on part of the node's CPUs (sinfo: drng), and on all of them.
DRAINING_MIXED = oneliner("MIXED+DRAIN", "admin check [root@2024-05-02T10:06:28]")
DRAINING_ALLOCATED = oneliner(
    "ALLOCATED+DRAIN", "GPU 2: uncorrectable ECC (ticket #4711) [root@2024-05-02T10:07:56]"
)
DOWN_WITH_REASON = oneliner("DOWN", "cable swap [root@2024-05-02T10:07:58]")
RESUMED_NOT_RESPONDING = oneliner("IDLE+NOT_RESPONDING")
DOWN_DRAINED = oneliner("DOWN+DRAIN+NOT_RESPONDING", "Not responding [slurm@2024-05-02T11:00:00]")
# Slurm 23.11 on: ResumeAfterTime, and fields after Reason.
NEWER = (
    oneliner("MIXED+DRAIN+PLANNED", "reboot for kernel 6.6 [ops@2024-05-02T12:00:00]").rstrip()
    + " Comment=rack 7 Extra=gpu-fw ReservationName=maint\n"
).replace(
    "LastBusyTime=2024-05-02T10:06:18", "LastBusyTime=2024-05-02T10:06:18 ResumeAfterTime=None"
)
# Before 2.2: one word, and * for a node that does not answer.
OLD_DRAINED = oneliner("DRAINED*", "power supply [root@2010-01-01T00:00:00]")
OLD_DRAINING = oneliner("DRAINING", "firmware")
# Without --oneliner: one field group per line.
MULTILINE = """NodeName=node2 Arch=x86_64 CoresPerSocket=1
   CPUAlloc=0 CPUEfctv=4 CPUTot=4 CPULoad=1.71
   NodeAddr=127.0.0.1 NodeHostName=localhost Port=17002 Version=22.05.8
   RealMemory=4000 AllocMem=0 FreeMem=22337 Sockets=4 Boards=1
   State=IDLE+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=debug
   CurrentWatts=0 AveWatts=0
   Reason=maintenance: bad DIMM [root@2024-05-02T10:06:18]

"""


@pytest.mark.parametrize(
    "text, state, reason",
    [
        (DRAINED_IDLE, "IDLE+DRAIN", "maintenance: bad DIMM"),
        (DRAINING_MIXED, "MIXED+DRAIN", "admin check"),
        (DRAINING_ALLOCATED, "ALLOCATED+DRAIN", "GPU 2: uncorrectable ECC (ticket #4711)"),
        (DOWN_DRAINED, "DOWN+DRAIN+NOT_RESPONDING", "Not responding"),
        (NEWER, "MIXED+DRAIN+PLANNED", "reboot for kernel 6.6"),
        (OLD_DRAINED, "DRAINED*", "power supply"),
        (OLD_DRAINING, "DRAINING", "firmware"),
        (MULTILINE, "IDLE+DRAIN", "maintenance: bad DIMM"),
    ],
)
def test_a_node_marked_for_draining_gives_the_admins_reason(text, state, reason):
    assert node_state(text) == state
    assert drain_reason(text) == reason


@pytest.mark.parametrize(
    "text, state",
    [
        (IDLE, "IDLE"),
        (DOWN_WITH_REASON, "DOWN"),  # a reason, but not a drain
        (RESUMED_NOT_RESPONDING, "IDLE+NOT_RESPONDING"),
        (oneliner("MIXED+COMPLETING"), "MIXED+COMPLETING"),
        (oneliner("IDLE+RESERVED", "to DRAIN after the reservation"), "IDLE+RESERVED"),
    ],
)
def test_a_node_not_marked_for_draining_gives_none(text, state):
    assert node_state(text) == state
    assert drain_reason(text) is None


def test_a_drain_without_a_reason_still_reads_as_marked():
    assert drain_reason(oneliner("IDLE+DRAIN")) == "no reason given"


def test_text_without_a_state_is_not_a_drain():
    assert node_state("Node nosuch not found\n") is None
    assert drain_reason("") is None
    assert drain_reason("Reason=DRAIN [root@2024-05-02T10:06:18]") is None


# ----- running scontrol (subprocess.run replaced: no process starts) -----
def fake_run(result):
    calls = []

    def run(command, **kwargs):
        calls.append((command, kwargs))
        if isinstance(result, BaseException):
            raise result
        return result

    return run, calls


def test_read_node_asks_scontrol_for_one_node_on_one_line(monkeypatch):
    run, calls = fake_run(subprocess.CompletedProcess([], 0, DRAINED_IDLE, ""))
    monkeypatch.setattr(slurm_state.subprocess, "run", run)
    assert slurm_state.read_node("node2", timeout_s=3.0) == DRAINED_IDLE
    ((command, kwargs),) = calls
    assert command == ["scontrol", "show", "node", "node2", "--oneliner"]
    assert kwargs["timeout"] == 3.0


@pytest.mark.parametrize(
    "result",
    [
        FileNotFoundError(2, "No such file or directory: 'scontrol'"),
        subprocess.TimeoutExpired(["scontrol"], 3.0),
        subprocess.CompletedProcess([], 1, "", "Node node9 not found\n"),
        subprocess.CompletedProcess([], 0, "", ""),
    ],
)
def test_read_node_gives_none_when_scontrol_is_missing_or_fails(monkeypatch, result):
    monkeypatch.setattr(slurm_state.subprocess, "run", fake_run(result)[0])
    assert slurm_state.read_node("node2") is None


def test_own_node_needs_a_slurm_node_name_and_scontrol(monkeypatch):
    monkeypatch.setattr(slurm_state.shutil, "which", lambda name: "/usr/bin/" + name)
    assert slurm_state.own_node({"SLURMD_NODENAME": "node2"}) == "node2"
    assert slurm_state.own_node({}) is None
    monkeypatch.setattr(slurm_state.shutil, "which", lambda name: None)
    assert slurm_state.own_node({"SLURMD_NODENAME": "node2"}) is None
