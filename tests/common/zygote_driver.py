"""Run by test_zygote.py as a node's agent would be: fork the zygote first
thing (``Zygote.fork``), then fork workers from it, as SCENARIO says, and
write what the agent saw to REPORT (JSON).

    python zygote_driver.py SCENARIO REPORT -- COMMAND...

  codes    two workers one after the other, exiting 7 and 0
  signals  two sleeping workers; SIGKILL one, then close the zygote
  orphan   one sleeping worker; then wait to be killed (the agent's death)
"""

import json
import os
import sys
import time

from deadpool_ext.control.zygote import ForkedWorker, Zygote

SCENARIO, REPORT = sys.argv[1], sys.argv[2]
COMMAND = sys.argv[sys.argv.index("--") + 1 :]
OUT = os.path.dirname(REPORT)


def spawn(zygote: Zygote, name: str, code, calls=None) -> ForkedWorker:
    env = dict(os.environ, OUT=os.path.join(OUT, f"{name}.json"), CODE=str(code))
    return zygote.spawn(env, while_waiting=lambda: calls.append(1) if calls is not None else None)


def wait_for_end(worker: ForkedWorker) -> int:
    while worker.poll() is None:
        time.sleep(0.05)
    return worker.returncode


def wait_for_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.05)


def report(**seen) -> None:
    with open(REPORT + ".part", "w") as f:
        json.dump(seen, f)
    os.rename(REPORT + ".part", REPORT)


def codes(zygote: Zygote) -> None:
    calls = []
    ended = {}
    for name, code in (("a", 7), ("b", 0)):
        ended[name] = wait_for_end(spawn(zygote, name, code, calls))
    with open(f"/proc/{zygote.process.pid}/cmdline", "rb") as f:
        own = f.read().decode().rstrip("\0").split("\0")
    zygote.close()
    report(zygote=zygote.process.pid, cmdline=own, codes=ended, calls=len(calls))


def signals(zygote: Zygote) -> None:
    killed, left = spawn(zygote, "killed", "sleep"), spawn(zygote, "left", "sleep")
    wait_for_file(os.path.join(OUT, "left.json"))
    killed.kill()
    code = wait_for_end(killed)
    left_running = left.poll() is None
    zygote.close()
    report(killed=code, left_running=left_running, left=left.pid)


def orphan(zygote: Zygote) -> None:
    worker = spawn(zygote, "orphan", "sleep")
    wait_for_file(os.path.join(OUT, "orphan.json"))
    report(zygote=zygote.process.pid, worker=worker.pid)
    time.sleep(120)


# Forked first, as in the agent's main: outside any try (see Zygote.fork).
ZYGOTE = Zygote.fork(COMMAND)
if ZYGOTE is None:  # the zygote after this process hung up, or a worker whose script returned
    sys.exit(0)
{"codes": codes, "signals": signals, "orphan": orphan}[SCENARIO](ZYGOTE)
