"""A node's zygote: one process that imports torch and megatron-core once and forks the workers.

Each worker then runs the worker command's script as ``python -u script
args`` would.

Why: a rank spends most of its start importing (about 8 s of CPU on a
2-core machine, torch and megatron-core's own modules), and a node starts
all its ranks at once, spares included; forked from a zygote they share
one import. A worker's life is unchanged: its environment, arguments,
``sys.path``, standard streams and command line (``/proc/PID/cmdline``, what
ps and pgrep show) are the command's; it dies with its parent (the zygote,
which dies with the agent); its exit code reaches the agent as a child's
would.

Only where CUDA is absent (``forks_workers``): a process that forks after
CUDA was initialised hands its children a broken CUDA context, and on a
GPU node Transformer Engine's and megatron-core's imports may initialise it.
There the agent starts each worker with its command, as before.

The zygote is the agent forked (``Zygote.fork``, first thing in the agent's
``main``): the agent has imported torch for the store's client, so the
zygote imports only megatron-core on top, about 2.3 s of CPU less per node
than a zygote started as a process of its own. Requests and answers over
their socket pair are JSON lines: ``{"env": {...}}`` -> ``{"pid": N}``, and
``{"exited": N, "code": C}`` for each worker that ends (C as
``subprocess.Popen.returncode``).
"""

import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from deadpool_ext.lifetime import die_with_parent

FORK_WORKERS_ENV = "DEADPOOL_FORK_WORKERS"
# What a rank imports before its first iteration, beyond megatron-core's
# package: imported once here. (A module missing here is the worker's to
# report, when it imports it.)
PRELOAD = (
    "megatron.training.training",
    "megatron.training.data",
    "megatron.training.model_setup",
    "megatron.training.checkpointing",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.datasets.gpt_dataset",
    "deadpool_ext.rank.main",
    # torch's optimizers import TorchDynamo when the first one is built (a
    # decorator of their __init__): 1.3 s of a spare's build after a failure.
    "torch._dynamo",
)


def forks_workers() -> bool:
    """Whether this node's workers are forked from a zygote: where there is
    no CUDA, unless ``FORK_WORKERS_ENV`` is 0 (then each starts with its
    command, as on a GPU node)."""
    import torch

    return os.environ.get(FORK_WORKERS_ENV, "1") != "0" and not torch.cuda.is_available()


def script_of(command: List[str]) -> int:
    """Where the script (or the module) stands in ``python [options]
    script args`` (``python [options] -m module args``)."""
    index = 1
    while command[index].startswith("-"):
        index += 1
    return index


def is_module(command: List[str]) -> bool:
    return "-m" in command[: script_of(command)]


def preload(command: List[str]) -> None:
    script = script_of(command)
    # As ``python script``: the script's folder first on the path (with -m,
    # the working folder).
    sys.path[0] = (
        os.getcwd() if is_module(command) else os.path.dirname(os.path.abspath(command[script]))
    )
    from megatron.training import cpu_compat, tokenizer

    cpu_compat.import_megatron_core_without_cuda()
    # Its tokenizers, with transformers only if a rank may build Hugging Face's.
    tokenizer.import_for_script_args(command[script + 1 :])
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    # What is imported stays: out of the collector's sight, a worker's
    # collections neither walk it (a full pass over it holds the GIL for
    # seconds, starving the heartbeat) nor copy its pages.
    gc.collect()
    gc.freeze()


def rename(command: List[str]) -> None:
    """Make ``/proc/self/cmdline`` the command's: rewrite the argument area
    the kernel shows (its bounds are fields 48 and 49 of /proc/self/stat),
    cut to fit. The agent's arguments hold the command as JSON (its
    ``--command``), longer than the command and the zygote's own line; a
    node launcher's hold its script's arguments, longer than a worker's."""
    import ctypes

    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])
    text = b"\0".join(arg.encode() for arg in command) + b"\0"
    # The area's last byte stays NUL: else Linux reads the line as one
    # string that setproctitle(3) wrote and shows its first argument alone.
    text = text[: end - start - 1].ljust(end - start, b"\0")
    ctypes.memmove(start, text, len(text))


def become_worker(
    channel: socket.socket, wakeup: int, command: List[str], env: dict, zygote: int
) -> None:
    """In the forked child: turn into ``command`` run with ``env``; returns
    only into the script, which ends the process. It dies with the zygote
    from the start (the worker asks again for its own reasons)."""
    if not die_with_parent(zygote):
        return  # the zygote is gone already, and its agent: nobody waits for this one
    channel.close()
    os.close(wakeup)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's own ignores it
    os.environ.clear()
    os.environ.update(env)
    rename(command)
    run_script(command)


def run_script(command: List[str]) -> None:
    """Run ``command``'s script (or module) in this process as ``python
    [options] script args`` would: its arguments, the path's first entry."""
    import runpy

    script = script_of(command)
    sys.argv = command[script:]
    if is_module(command):
        sys.path[0] = os.getcwd()
        runpy.run_module(command[script], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(command[script]))
        runpy.run_path(command[script], run_name="__main__")


def wake_on_child_exit() -> Tuple[int, int]:
    """A pipe that a byte reaches whenever a child ends (select on the first
    end); the second end is the signal's to write."""
    wakeup, notify = os.pipe()
    os.set_blocking(notify, False)
    signal.set_wakeup_fd(notify)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return wakeup, notify


def ended_children() -> Iterator[Tuple[int, int]]:
    """(pid, exit code as ``Popen.returncode``) of each child that ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def serve(channel: socket.socket, command: List[str]) -> None:
    """Fork a worker for each request, report each that ends; return when
    the agent hangs up (its workers then die with this process)."""
    wakeup, _ = wake_on_child_exit()
    pending = b""
    while True:
        ready, _, _ = select.select([channel, wakeup], [], [])
        if wakeup in ready:
            os.read(wakeup, 4096)
        reap(channel)
        if channel not in ready:
            continue
        received = channel.recv(1 << 16)
        if not received:
            return
        pending += received
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            zygote = os.getpid()
            pid = os.fork()
            if pid == 0:
                become_worker(channel, wakeup, command, json.loads(line)["env"], zygote)
                return
            channel.sendall((json.dumps({"pid": pid}) + "\n").encode())


def reap(channel: socket.socket) -> None:
    for pid, code in ended_children():
        channel.sendall((json.dumps({"exited": pid, "code": code}) + "\n").encode())


# ----- the agent's side -----


class ZygoteLost(RuntimeError):
    """The zygote ended while the agent needed it."""


class Signalled:
    """``subprocess.Popen``'s signalling, for a process known by its ``pid``
    whose ``returncode`` is set once it was seen to end."""

    pid: int
    returncode: Optional[int] = None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # ended; word of it is on its way

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkedWorker(Signalled):
    """A worker forked by the zygote, with the part of ``subprocess.Popen``
    the agent uses."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid = zygote, pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        self.zygote.collect()
        return self.returncode


class ForkedProcess(Signalled):
    """A child this process forked, with the part of ``subprocess.Popen``
    its parent uses (the agent of its zygote, a standalone launcher of the
    agents it forked)."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """As ``Popen.wait``: ``subprocess.TimeoutExpired`` after ``timeout`` s."""
        if timeout is None:
            if self.returncode is None:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


class Zygote:
    """A node's zygote for ``command``, seen from its agent: forks workers."""

    def __init__(self, process: ForkedProcess, channel: socket.socket):
        self.process, self.channel, self.pending = process, channel, b""
        self.workers: Dict[int, ForkedWorker] = {}

    @classmethod
    def fork(cls, command: List[str]) -> Optional["Zygote"]:
        """Fork this process into its node's zygote: the parent gets the
        zygote; None returns in the zygote once its agent hung up, and in a
        worker whose script returned (its ``main`` then ends). Call it
        before the process has threads of its own or connections a worker
        must not inherit, and outside any ``try``: in each worker forked from
        the zygote, the script's end (``SystemExit``, an exception) unwinds
        the caller's stack to the interpreter, as from ``python script``."""
        ours, theirs = socket.socketpair()
        agent = os.getpid()
        pid = os.fork()
        if pid == 0:
            ours.close()
            be_zygote(theirs, command, agent)
            return None
        theirs.close()
        return cls(ForkedProcess(pid), ours)

    def spawn(self, env: dict, while_waiting: Callable[[], None]) -> ForkedWorker:
        """A worker with ``env``; ``while_waiting`` is called every 0.1 s
        until the zygote answers (the first answer waits for its imports)."""
        self.channel.sendall((json.dumps({"env": env}) + "\n").encode())
        while True:
            for message in self.messages(timeout_s=0.1):
                if "pid" in message:
                    worker = self.workers[message["pid"]] = ForkedWorker(self, message["pid"])
                    return worker
            while_waiting()

    def collect(self) -> None:
        for _ in self.messages(timeout_s=0.0):
            pass

    def messages(self, timeout_s: float):
        """The zygote's messages that have come; workers' ends are noted."""
        self.channel.settimeout(timeout_s)
        try:
            received = self.channel.recv(1 << 16)
        except (BlockingIOError, socket.timeout):
            received = None
        self.pending += received or b""
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            message = json.loads(line)
            if "exited" in message and message["exited"] in self.workers:
                self.workers.pop(message["exited"]).returncode = message["code"]
            yield message
        if received == b"":
            self.lost()

    def lost(self) -> None:
        """Its workers died with it (parent-death signal)."""
        for worker in self.workers.values():
            worker.returncode = -signal.SIGKILL
        self.workers.clear()
        code = self.process.wait()
        raise ZygoteLost(f"the node's zygote ended with code {code}")

    def close(self) -> None:
        """End the zygote; any worker left dies with it."""
        self.channel.close()
        self.process.kill()
        self.process.wait()


def be_zygote(channel: socket.socket, command: List[str], agent: int) -> None:
    """The forked zygote's life: import, then fork workers until the agent
    hangs up (the workers then die with it)."""
    if not die_with_parent(agent):
        return  # the agent is gone already
    # A SIGTERM to the whole node (Slurm's time limit, scancel --signal=TERM)
    # is for the workers, which save a checkpoint, and for the agent; the
    # zygote ends when its agent hangs up, and its death would end them all.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rename([sys.executable, "-m", __spec__.name, json.dumps(command)])
    preload(command)
    serve(channel, command)
