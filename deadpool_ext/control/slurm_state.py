"""A node's state as Slurm's controller has it: whether the administrators
marked it for draining (``scontrol update NodeName=X State=DRAIN
Reason=...``), and why.

Slurm drains a node by letting its running jobs finish and starting no new
one there; a job of ours that keeps the node keeps it until its time limit.
The agent reads its own node's state (control/agent.py) and, once the node
is marked, asks the coordinator to drain it from the job at the next
iteration boundary, so the maintenance can start without ending the job.

The reading is ``scontrol show node NAME --oneliner``, one line of
``Key=Value`` fields (Slurm's src/api/node_info.c):

    NodeName=node2 Arch=x86_64 ... State=MIXED+DRAIN ThreadsPerCore=1 ...
    ExtSensorsTemp=n/s Reason=bad DIMM [root@2024-05-02T10:15:00]

State is the base state and its flags joined by ``+`` (``IDLE+DRAIN``,
``ALLOCATED+DRAIN``, ``DOWN+DRAIN+NOT_RESPONDING``); releases before 2.2
printed ``DRAINING`` and ``DRAINED``, with ``*`` for a node that does not
answer. Reason runs to the end of its line, where Slurm stamps who set it
and when, and newer releases may add Comment=, Extra=, InstanceId=,
InstanceType= or ReservationName= after it.
"""

import re
import shutil
import subprocess
import threading
from typing import Mapping, Optional

# A reading must never hold the agent: scontrol waits up to the
# controller's MessageTimeout (10 s by default) for an answer.
SCONTROL_TIMEOUT_S = 10.0
NODE_NAME_ENV = "SLURMD_NODENAME"  # srun sets it in every task: the slurmd's node name
DRAIN_FLAGS = {"DRAIN", "DRAINING", "DRAINED"}
# Fields scontrol may print after Reason on the same (one) line.
AFTER_REASON = ("Comment", "Extra", "InstanceId", "InstanceType", "ReservationName")
STATE = re.compile(r"(?:^|\s)State=(\S+)")
REASON = re.compile(r"(?:^|\s)Reason=([^\n]*)")
STAMP = re.compile(r"\s+\[[^\[\]@\s]+@[^\[\]\s]+\]\s*$")  # " [root@2024-05-02T10:15:00]"
FOLLOWING = re.compile(r"\s+(?:%s)=.*$" % "|".join(AFTER_REASON))


def own_node(environ: Mapping[str, str]) -> Optional[str]:
    """This process's Slurm node, where it runs in a Slurm job step and
    scontrol can be run; else None (nothing to watch)."""
    name = environ.get(NODE_NAME_ENV, "").strip()
    if not name or shutil.which("scontrol") is None:
        return None
    return name


def read_node(name: str, timeout_s: float = SCONTROL_TIMEOUT_S) -> Optional[str]:
    """``scontrol show node NAME --oneliner``'s output, or None when
    scontrol is missing, fails (an unknown node, the controller down) or
    does not answer within ``timeout_s``."""
    try:
        done = subprocess.run(
            ["scontrol", "show", "node", name, "--oneliner"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 and done.stdout.strip() else None


def node_state(text: str) -> Optional[str]:
    """The State field, e.g. ``MIXED+DRAIN``; None if there is none."""
    match = STATE.search(text)
    return match.group(1) if match else None


def marked_for_draining(state: str) -> bool:
    """Whether any of the state's parts is a drain (``*`` and the other
    one-character marks of older releases stripped)."""
    parts = (part.rstrip("*~#!%$@^-") for part in state.upper().split("+"))
    return any(part in DRAIN_FLAGS for part in parts)


def reason_of(text: str) -> str:
    """The administrators' Reason without Slurm's [user@time] stamp and the
    fields that may follow it; empty if none was given."""
    match = REASON.search(text)
    if match is None:
        return ""
    reason = FOLLOWING.sub("", match.group(1))
    return STAMP.sub("", reason).strip()


def drain_reason(state_text: str) -> Optional[str]:
    """None unless scontrol's text shows the node marked for draining; then
    the administrators' Reason ("no reason given" where there is none, so
    the answer is never falsy when the node is marked)."""
    state = node_state(state_text)
    if state is None or not marked_for_draining(state):
        return None
    return reason_of(state_text) or "no reason given"


class Reading:
    """One ``read_node`` in a daemon thread: the agent starts it and picks
    up its ``text`` once ``done()``, so a slow controller never delays its
    heartbeats (which the coordinator counts a node lost without)."""

    def __init__(self, name: str, timeout_s: float = SCONTROL_TIMEOUT_S):
        self.name, self.text = name, None
        self.thread = threading.Thread(
            target=self.read, args=(timeout_s,), name="deadpool-slurm-state", daemon=True
        )
        self.thread.start()

    def read(self, timeout_s: float) -> None:
        self.text = read_node(self.name, timeout_s)

    def done(self) -> bool:
        return not self.thread.is_alive()
