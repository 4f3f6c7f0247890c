"""The test session's fork server: Python commands started from one process
that has already imported what they import.

    python -u forkserver.py SOCKET PADDING     (started by ``start``)

Why: nearly every integration test starts ``python -u script args``,
``python -m module args`` or ``python -c code args`` (forkrun.py,
deadpool-launch, the tools), and each such process first spends about 8 s
of one core importing torch, megatron-core and the launcher before anything
of the test's runs; most runs here train for a few seconds after that. The
server imports all that once per session and forks each command's process
from there, as a node's zygote forks its workers
(``deadpool_ext.control.zygote``, whose helpers it uses): the process then
is the command's (arguments, ``/proc/PID/cmdline``, environment, working
folder, standard streams, exit code, a session of its own if asked) and
runs its code as ``python -u`` would, down to the interpreter's exit.

What it cannot be: a command whose interpreter must start otherwise.
``start`` hands back None (the caller then starts a process as before) for
options other than ``-u``, ``-m`` and ``-c``, for a ``PYTHON*`` variable
that differs from the server's (read at the interpreter's start:
``PYTHONPATH`` names the fake NVML of test_hot_swap's unhealthy spares),
for an interpreter other than ours, and for a probe of a fresh interpreter's
imports, which calls ``subprocess`` itself.

Protocol, over a Unix socket, one connection per process: the client sends
one JSON line ``{"command", "env", "cwd", "session"}`` with its stdin, stdout
and stderr as file descriptors; the server answers ``{"pid": N}`` and, once
the process ended, ``{"code": C}`` (as ``subprocess.Popen.returncode``).
"""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

from deadpool_ext.control.zygote import (
    Signalled,
    ended_children,
    preload,
    rename,
    run_script,
    script_of,
    wake_on_child_exit,
)
from deadpool_ext.lifetime import die_with_parent

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What the tests' commands import, beyond a rank's (zygote.PRELOAD).
EXTRA_PRELOAD = (
    "deadpool_ext.launch",
    "deadpool_ext.control.agent",
    "tools.chaos",
    "forkrun",
)
# The server's argument area, which a forked command's line is written into
# (zygote.rename cuts a longer one).
PADDING = 32_000


# ----- the server -----


def preload_all() -> None:
    import importlib

    # As for a rank of Hugging Face's tokenizer: megatron-core's tokenizers
    # with transformers (a rank of another imports them without it).
    script = [sys.executable, "-u", os.path.join(REPO, "pretrain_gpt.py")]
    preload(script + ["--tokenizer-type", "HuggingFaceTokenizer"])
    sys.path[0] = os.path.dirname(os.path.abspath(__file__))
    for name in EXTRA_PRELOAD:
        importlib.import_module(name)


def receive(conn: socket.socket):
    """One request: its JSON and the three descriptors."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the client hung up mid-request")
        data += more
    return json.loads(data), fds


def become(request: dict, fds: List[int], server: int) -> None:
    """In the forked child: turn into the request's command; returns only
    when its script returned (the process then ends as Python's does)."""
    if not die_with_parent(server):
        return
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    if request["session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    command = request["command"]
    rename(command)
    if "-c" in command[1 : script_of(command)]:
        run_code(command)
    else:
        run_script(command)


def run_code(command: List[str]) -> None:
    """``python [-u] -c CODE args`` in this process: CODE run as the module
    ``__main__``, ``sys.argv`` and the path's first entry as Python sets them."""
    import builtins
    import types

    index = script_of(command)
    sys.argv = ["-c", *command[index + 1 :]]
    sys.path[0] = ""
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    exec(compile(command[index], "<string>", "exec"), main.__dict__)


def serve(listener: socket.socket) -> bool:
    """Fork a process per request, report each that ends. False returns in
    a forked process whose script returned; the server never returns."""

    wakeup, notify = wake_on_child_exit()
    clients: Dict[int, socket.socket] = {}
    while True:
        ready, _, _ = select.select([listener, wakeup], [], [])
        if wakeup in ready:
            os.read(wakeup, 4096)
            for pid, code in ended_children():
                if pid in clients:
                    send(clients.pop(pid), {"code": code})
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        request, fds = receive(conn)
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            for sock in [listener, conn, *clients.values()]:
                sock.close()
            os.close(wakeup)
            os.close(notify)
            become(request, fds, server)
            return False
        for fd in fds:
            os.close(fd)
        clients[pid] = conn
        send(conn, {"pid": pid})


def send(conn: socket.socket, message: dict) -> None:
    """Send; a process's end closes its connection."""
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass  # the client gave up on this process
    if "code" in message:
        conn.close()


def main() -> int:

    if not die_with_parent(int(os.environ["FORKSERVER_PARENT"])):
        return 1
    preload_all()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sys.argv[1])
    listener.listen(64)
    # No try or finally here: a forked process leaves through this stack.
    serve(listener)
    return 0


# ----- the client (the test process) -----


class ServedProcess(Signalled):
    """A process the server forked, with the part of ``subprocess.Popen``
    the tests use."""

    def __init__(self, conn: socket.socket, pid: int, args: List[str]):
        self.conn, self.pid, self.args = conn, pid, args
        self.returncode: Optional[int] = None
        self.pending = b""

    def poll(self) -> Optional[int]:
        return self._read(0.0)

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (
            self._read(None if deadline is None else max(0.0, deadline - time.monotonic())) is None
        ):
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _read(self, timeout: Optional[float]) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        ready, _, _ = select.select([self.conn], [], [], timeout)
        if ready:
            received = self.conn.recv(4096)
            if not received:
                raise ConnectionError("the fork server ended")
            self.pending += received
            if b"\n" in self.pending:
                self.returncode = json.loads(self.pending.split(b"\n", 1)[0])["code"]
                self.conn.close()
        return self.returncode


class Server:
    def __init__(self):
        self.process: Optional[subprocess.Popen] = None
        self.path = None
        self.env: Dict[str, str] = {}

    def ensure_started(self) -> None:
        if self.process is not None:
            return
        import tempfile

        from dist_utils import worker_env

        env = worker_env()
        self.path = os.path.join(tempfile.mkdtemp(prefix="forkserver-"), "socket")
        self.env = {**env, "FORKSERVER_PARENT": str(os.getpid())}
        self.process = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__), self.path, "-" * PADDING],
            env=self.env,
            cwd=REPO,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while not os.path.exists(self.path):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start ({self.process.returncode})")
            time.sleep(0.1)

    def serves(self, command: List[str], env: Dict[str, str]) -> bool:

        if command[0] != sys.executable or len(command) < 2:
            return False
        if any(option not in ("-u", "-m", "-c") for option in command[1 : script_of(command)]):
            return False
        self.ensure_started()
        python = {k for k in {**env, **self.env} if k.startswith("PYTHON")}
        return all(env.get(k) == self.env.get(k) for k in python)

    def start(
        self,
        command: List[str],
        env: Dict[str, str],
        cwd: str,
        stdout: int,
        stderr: int,
        new_session: bool = False,
    ) -> ServedProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = {"command": command, "env": env, "cwd": cwd, "session": new_session}
        with open(os.devnull) as stdin:
            fds = [stdin.fileno(), stdout, stderr]
            socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], fds)
        pending = b""
        while b"\n" not in pending:
            received = conn.recv(4096)
            if not received:
                raise ConnectionError("the fork server ended")
            pending += received
        line, rest = pending.split(b"\n", 1)
        process = ServedProcess(conn, json.loads(line)["pid"], command)
        process.pending = rest
        return process


SERVER = Server()


def start(command, env, cwd, stdout, stderr, new_session=False) -> Optional[ServedProcess]:
    """``command`` forked by the session's server, or None where it cannot
    be (see the module's docstring): the caller starts it as before."""
    if not SERVER.serves(command, env):
        return None
    return SERVER.start(command, env, cwd, stdout, stderr, new_session)


def start_logged(command, env, cwd, log):
    """``command`` in a session of its own, its output in ``log`` (an open
    file): forked by the server where it can be, else started."""
    served = start(command, env, cwd, log.fileno(), log.fileno(), new_session=True)
    return served or subprocess.Popen(
        command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def run(command, env, cwd, timeout: float) -> subprocess.CompletedProcess:
    """As ``subprocess.run(command, env=env, cwd=cwd, capture_output=True,
    text=True, timeout=timeout)``, forked by the server where it can be."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        process = start(command, env, cwd, out_w, err_w)
    finally:
        os.close(out_w)
        os.close(err_w)
    if process is None:
        os.close(out_r)
        os.close(err_r)
        return subprocess.run(
            command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
    deadline = time.monotonic() + timeout
    chunks = {out_r: [], err_r: []}
    open_fds = [out_r, err_r]
    while open_fds:
        left = deadline - time.monotonic()
        if left <= 0:
            process.kill()
            for fd in open_fds:
                os.close(fd)
            raise subprocess.TimeoutExpired(command, timeout)
        ready, _, _ = select.select(open_fds, [], [], left)
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if data:
                chunks[fd].append(data)
            else:
                os.close(fd)
                open_fds.remove(fd)
    code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
    out, err = (b"".join(chunks[fd]).decode(errors="replace") for fd in (out_r, err_r))
    return subprocess.CompletedProcess(command, code, out, err)


if __name__ == "__main__":
    sys.exit(main())
