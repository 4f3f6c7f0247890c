"""One agent per node: starts the node's workers (active ranks or warm
spares), reports their exits at once, beats for the node, and carries out
the coordinator's commands (kill a hung worker, stop).

Run by the launcher; ``python -m deadpool_ext.agent`` takes its settings
from the environment the launcher sets (the secret never goes on a command
line, where other users could read it).
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, List, NoReturn

import torch.distributed as dist

from deadpool_ext.control import Channel, connect, job_secret, parse_slot, slot_name

RELEASED_EXIT_CODE = 4  # recovery.RELEASED_EXIT_CODE (not imported: keeps the agent light)


class Agent:
    def __init__(self, channel: Channel, node: int, nproc: int, active: bool, world_size: int,
                 command: List[str], store_addr: str, heartbeat_s: float = 0.5,
                 join: bool = False):
        self.channel, self.node, self.nproc = channel, node, nproc
        self.active, self.world_size, self.command = active, world_size, command
        self.store_addr, self.heartbeat_s = store_addr, heartbeat_s
        self.workers: Dict[str, subprocess.Popen] = {}
        self.commands = channel.reader(f"agent/{node}")
        self.join, self.refused = join, None
        self.nonce = secrets.token_hex(8) if join else None  # where the admission comes
        if join:
            # A repaired node takes its old index: its predecessor's commands
            # (kill_all when it was lost) are not for this agent.
            self.commands.skip_history()
        self.stopping = False
        self.seq = 0

    def worker_env(self, local: int, active: bool) -> dict:
        env = dict(os.environ)
        slot = slot_name(self.node, local)
        env.update(DEADPOOL_SLOT=slot, DEADPOOL_ROLE="active" if active else "spare",
                   DEADPOOL_STORE=self.store_addr, DEADPOOL_NODE=str(self.node),
                   DEADPOOL_RANKS_PER_NODE=str(self.nproc), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(self.nproc), WORLD_SIZE=str(self.world_size))
        if active:
            env["RANK"] = str(self.node * self.nproc + local)
        return env

    def start(self) -> None:
        for local in range(self.nproc):
            self.workers[slot_name(self.node, local)] = subprocess.Popen(
                self.command, env=self.worker_env(local, self.active))
        self.channel.post("coordinator", kind="node", node=self.node, active=self.active,
                          join=self.join, nproc=self.nproc, nonce=self.nonce,
                          pids={s: p.pid for s, p in self.workers.items()})

    def beat(self) -> None:
        self.seq += 1
        self.channel.put(f"hb/node/{self.node}", seq=self.seq, time=time.time())

    def watch_once(self) -> None:
        for slot, proc in list(self.workers.items()):
            code = proc.poll()
            if code is not None:
                del self.workers[slot]
                if not self.stopping:
                    self.channel.post("coordinator", kind="exit", slot=slot, code=code)
                if code == RELEASED_EXIT_CODE and not self.stopping:
                    # A shrink dropped its replica: the slot serves as a warm spare.
                    local = parse_slot(slot)[1]
                    self.workers[slot] = subprocess.Popen(
                        self.command, env=self.worker_env(local, active=False))
        if self.nonce is not None:
            self.check_admission()
        for command in self.commands.poll():
            self.obey(command)

    def check_admission(self) -> None:
        """A joining node waits for the coordinator's answer; refused, it stops."""
        answer = self.channel.get(f"admit/{self.nonce}")
        if answer is None:
            return
        self.nonce = None
        if not answer["accepted"]:
            self.refused = answer["reason"]
            print(f"deadpool-launch --join: refused: {self.refused}", file=sys.stderr,
                  flush=True)
            self.obey({"kind": "stop"})

    def obey(self, command: dict) -> None:
        kind = command.get("kind")
        if kind == "kill" and command.get("slot") in self.workers:
            self.workers[command["slot"]].kill()
            self.workers[command["slot"]].send_signal(signal.SIGCONT)  # a stopped one too
        elif kind in ("kill_all", "stop"):
            self.stopping = kind == "stop"
            for proc in self.workers.values():
                proc.terminate() if kind == "stop" else proc.kill()

    def run(self) -> int:
        self.start()
        last = 0.0
        try:
            while self.workers:
                if time.monotonic() - last >= self.heartbeat_s:
                    self.beat()
                    last = time.monotonic()
                self.watch_once()
                time.sleep(0.02)
        except dist.DistError:
            # The coordinator is gone, and with it the job: leave no orphans.
            # After its stop command that is the normal end of the job.
            stopped = self.stopping
            self.obey({"kind": "kill_all"})
            leave(0 if stopped else 1)
        return 2 if self.refused else 0


def leave(code: int) -> NoReturn:
    """Exit without destroying the store client: when the store's server
    (node 0's launcher) is already gone, its thread aborts the interpreter's
    exit ("terminate called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> NoReturn:
    settings = json.loads(os.environ["DEADPOOL_AGENT"])
    host, port = settings["store"].rsplit(":", 1)
    store = connect(host, int(port), timeout_s=settings.get("connect_timeout", 120))
    agent = Agent(Channel(store, job_secret()), settings["node"], settings["nproc"],
                  settings["active"], settings["world_size"], settings["command"],
                  settings["store"], join=settings.get("join", False))
    signal.signal(signal.SIGTERM, lambda *_: agent.obey({"kind": "stop"}))
    threading.current_thread().name = f"deadpool-agent-{settings['node']}"
    leave(agent.run())


if __name__ == "__main__":
    sys.exit(main())
