"""One agent per node: it starts the node's workers and carries out the coordinator's commands.

Its workers are active ranks or warm spares; it reports their exits at once,
beats for the node, and kills a hung worker or stops when told to.

Run by the launcher, ``python -m deadpool_ext.control.agent --command JSON``
(the workers' command, which ps then shows for the node), with its other
settings in the environment the launcher sets (the secret never goes on a
command line, where other users could read it).
"""

import json
import os
import secrets
import signal
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

import torch.distributed as dist

from deadpool_ext import protocol as P
from deadpool_ext.control import slurm_state
from deadpool_ext.control.gpu_health import NvmlReader, NvmlUnavailable
from deadpool_ext.control.zygote import Zygote, forks_workers
from deadpool_ext.defaults import (
    CONTROL_SILENCE_S,
    GPU_HEALTH_INTERVAL_S,
    HEARTBEAT_INTERVAL_S,
    LEAVE_GRACE_S,
    SLURM_STATE_INTERVAL_S,
    WORKER_ENV_DEFAULTS,
)
from deadpool_ext.protocol import Command, ExitCode, Role, WorkerEnv, parse_slot, slot_name
from deadpool_ext.wire import (
    Channel,
    JobEnded,
    control_connect,
    job_secret,
    leave,
    next_coordinator,
)


class Agent:
    def __init__(
        self,
        channel: Channel,
        node: int,
        nproc: int,
        active: bool,
        world_size: int,
        command: List[str],
        store_addr: str,
        heartbeat_s: float = HEARTBEAT_INTERVAL_S,
        join: bool = False,
        standby_store: Optional[str] = None,
        first_standby: Optional[str] = None,
        takeover_wait_s: float = 0.0,
        zygote: Optional[Zygote] = None,
        scratch: Optional[str] = None,
        gpus: Optional[NvmlReader] = None,
        slurm_node: Optional[str] = None,
    ):
        """``standby_store``: host:port of the store this node's launcher
        serves for a standby coordinator, announced to the coordinator. The
        generation names the standby the agent turns to when it loses the
        primary, waiting up to ``takeover_wait_s`` for the takeover. ``zygote``: the node's zygote
        (control/zygote.py), which forks the workers; without one each is
        started with the command. ``scratch``: where to make the folder of
        the workers' error files (default: the system's temporary folder);
        a standalone launcher gives its own, which it removes whatever
        became of the agent. ``gpus``: NVML, to read the health of the
        workers' GPUs (None where there is none). ``slurm_node``: this
        node's Slurm name, whose state is watched for a DRAIN (None outside
        a Slurm job)."""
        self.channel, self.node, self.nproc = channel, node, nproc
        self.active, self.world_size, self.command = active, world_size, command
        self.store_addr, self.heartbeat_s = store_addr, heartbeat_s
        self.workers: Dict[str, subprocess.Popen] = {}
        self.commands = channel.reader(P.agent_topic(node))
        self.join, self.refused = join, None
        self.nonce = secrets.token_hex(8) if join else None  # where the admission comes
        if join:
            # A repaired node takes its old index: its predecessor's commands
            # (kill_all when it was lost) are not for this agent.
            self.commands.skip_history()
        self.stopping = False
        self.said_stopping = False  # stopping_key put
        # It obeyed a KILL_ALL, or every worker found no place for its slot in
        # the decision it read (rank/recovery.py): the node was declared lost.
        self.declared_lost = False
        self.exit_codes: Dict[str, int] = {}  # slot -> its last worker's exit code
        # Drained: no worker is started again; those still running after
        # the grace (spares, a member that did not read its release) stop.
        self.leaving_by: Optional[float] = None
        self.leave_signals = 0
        self.standby_store, self.takeover_wait_s = standby_store, takeover_wait_s
        # host:port of the standby that holds the coordinator's copy, as the
        # last generation read said (None: none does).
        self.standby: Optional[str] = None
        # Node 1's, appointed first: workers started before a generation
        # named the standby are told of it.
        self.first_standby = first_standby
        self.error_dir = tempfile.mkdtemp(prefix=f"deadpool-node{node}-", dir=scratch)
        self.zygote = zygote
        self.last_beat = 0.0
        self.gpus, self.gpu_verdicts = gpus, None
        self.next_gpu_check, self.checked_failure_gen = 0.0, None
        self.slurm_node, self.slurm_reading = slurm_node, None
        self.next_slurm_check = 0.0
        self.slurm_drain_asked = False  # for the DRAIN marking read last

    def error_file(self, slot: str) -> str:
        return os.path.join(self.error_dir, f"{slot}.error")

    def written_reason(self, slot: str) -> Optional[str]:
        """Why a worker stopped, if it wrote it (its flags refused, or the
        failure that stopped it)."""
        try:
            with open(self.error_file(slot)) as f:
                return f.read()[: P.ERROR_TEXT_LIMIT]
        except OSError:
            return None

    def start_worker(self, local: int, active: bool) -> None:
        slot = slot_name(self.node, local)
        if self.zygote is None:
            self.workers[slot] = subprocess.Popen(self.command, env=self.worker_env(local, active))
            return
        # A forked worker's parent, whose death it dies with, is the zygote.
        env = self.worker_env(local, active, parent_pid=self.zygote.process.pid)
        self.workers[slot] = self.zygote.spawn(env, while_waiting=self.beat_or_fail_over)

    def worker_env(self, local: int, active: bool, parent_pid: Optional[int] = None) -> dict:
        worker = WorkerEnv(
            slot=slot_name(self.node, local),
            role=Role.ACTIVE if active else Role.SPARE,
            node=self.node,
            store=self.store_addr,
            standby=self.standby or self.first_standby,
            takeover_wait_s=self.takeover_wait_s,
            cut_off_s=self.channel.cut_off_s,
            ranks_per_node=self.nproc,
            world_size=self.world_size,
            rank=self.node * self.nproc + local if active else None,
            error_file=self.error_file(slot_name(self.node, local)),
            agent_pid=os.getpid(),
            parent_pid=parent_pid or os.getpid(),
        )
        return {**WORKER_ENV_DEFAULTS, **os.environ, **worker.variables()}

    def start(self) -> None:
        if self.join:  # its predecessor's word that it stopped is not this agent's
            self.channel.put(P.stopping_key(self.node), pending=True)
        # Announced first: a joining node's spares were ignored as lost slots
        # when their readiness reached the coordinator before this did.
        self.channel.post(
            P.COORDINATOR_TOPIC,
            P.NodeUp(
                node=self.node,
                active=self.active,
                nproc=self.nproc,
                join=self.join,
                nonce=self.nonce,
                world_size=self.world_size,
                standby_store=self.standby_store,
            ),
        )
        self.check_gpus(now=True)  # before any spare can say it is ready
        for local in range(self.nproc):
            self.start_worker(local, self.active)

    def check_gpus(self, now: bool = False) -> None:
        """Read the workers' GPUs when due (or ``now``) and tell the
        coordinator when a verdict changed (control/gpu_health.py)."""
        if self.gpus is None or (not now and time.monotonic() < self.next_gpu_check):
            return
        self.next_gpu_check = time.monotonic() + GPU_HEALTH_INTERVAL_S
        try:
            found = self.gpus.read_workers(list(range(self.nproc)))
        except Exception as error:  # noqa: BLE001 - a check that breaks must not stop the node
            print(
                f"deadpool agent {self.node}: GPU health checks stop: {type(error).__name__}: "
                f"{error}",
                file=sys.stderr,
                flush=True,
            )
            self.gpus = None
            return
        readings = {slot_name(self.node, local): reading for local, reading in found.items()}
        verdicts = {slot: reading.problems() for slot, reading in readings.items()}
        if verdicts != self.gpu_verdicts:
            self.gpu_verdicts = verdicts
            body = {slot: reading.to_dict() for slot, reading in readings.items()}
            self.channel.post(P.COORDINATOR_TOPIC, P.GpuHealth(node=self.node, readings=body))

    def check_slurm(self) -> None:
        """Read this node's Slurm state every SLURM_STATE_INTERVAL_S, in the
        background (control/slurm_state.py), and act on each reading."""
        if self.slurm_node is None:
            return
        if self.slurm_reading is None:
            if time.monotonic() >= self.next_slurm_check:
                self.start_slurm_reading()
            return
        if self.slurm_reading.done():
            text, self.slurm_reading = self.slurm_reading.text, None
            self.next_slurm_check = time.monotonic() + SLURM_STATE_INTERVAL_S
            self.on_slurm_state(text)

    def start_slurm_reading(self) -> None:
        try:
            self.slurm_reading = slurm_state.Reading(self.slurm_node)
        except RuntimeError as error:  # no thread to be had: the watch stops, never the node
            print(
                f"deadpool agent {self.node}: Slurm state no longer watched: {error}",
                file=sys.stderr,
                flush=True,
            )
            self.slurm_node = None

    def on_slurm_state(self, text: Optional[str]) -> None:
        """Ask for this node's drain once per DRAIN marking. A failed
        reading (None) changes nothing: the next one may work. A node
        resumed and marked again is asked for again."""
        if text is None:
            return
        reason = slurm_state.drain_reason(text)
        if reason is None:
            self.slurm_drain_asked = False
        elif not self.slurm_drain_asked:
            self.ask_drain(slurm_state.node_state(text), reason)
            self.slurm_drain_asked = True

    def ask_drain(self, state: str, reason: str) -> None:
        """The request deadpool-ctl drain would send, for this node. Asking
        again is harmless; the coordinator's answer and the drain itself go
        to its event log."""
        why = f"Slurm marked {self.slurm_node} {state}: {reason}"
        print(
            f"deadpool agent {self.node}: {why}; asking to drain this node",
            file=sys.stderr,
            flush=True,
        )
        request = P.ControlRequest(
            request=P.Request.DRAIN.value,
            nonce=secrets.token_hex(8),
            node=self.node,
            reason=why,
            by="slurm",
        )
        self.channel.post(P.CONTROL_TOPIC, request)

    def beat_when_due(self) -> None:
        if time.monotonic() - self.last_beat >= self.heartbeat_s:
            self.beat()
            self.last_beat = time.monotonic()

    def beat_or_fail_over(self) -> None:
        """A beat while the zygote starts a worker (its first answer waits
        for its imports); a coordinator lost meanwhile is handled as in
        ``run_workers``: the standby, if one takes over."""
        try:
            self.beat_when_due()
        except dist.DistError:
            if self.stopping or not self.fail_over():
                raise

    def beat(self) -> None:
        # The channel numbers every put: each is a new beat.
        self.channel.put(P.node_heartbeat_key(self.node), time=time.time())
        latest = self.channel.get(P.GEN_KEY) or {}
        if latest:
            self.standby = latest.get("standby")  # where to fail over (fail_over)
        failing = latest.get("state") == P.JobState.RECOVERING
        if failing and latest["gen"] != self.checked_failure_gen:
            # A failure: spares are about to be used, so read their GPUs now.
            self.checked_failure_gen = latest["gen"]
            self.check_gpus(now=True)

    def watch_once(self) -> None:
        # Commands first: a drained node's LEAVE comes before its workers'
        # release, which must then not start spares in their slots.
        for command in self.commands.poll():
            self.obey(command)
        if self.stopping:
            # Here, not in ``obey``: SIGTERM's handler obeys too, and must
            # not write to the store in the middle of another request.
            self.say_stopping()
        if self.leaving_by is not None and time.monotonic() > self.leaving_by:
            self.stop_leftovers()
        for slot, proc in list(self.workers.items()):
            code = proc.poll()
            if code is not None:
                del self.workers[slot]
                self.exit_codes[slot] = code
                if not self.stopping:
                    reason = self.written_reason(slot) if code != ExitCode.OK else None
                    exited = P.WorkerExited(slot=slot, code=code, reason=reason)
                    self.channel.post(P.COORDINATOR_TOPIC, exited)
                if code == ExitCode.RELEASED and not self.stopping and self.leaving_by is None:
                    # A shrink dropped its replica: the slot serves as a warm spare.
                    self.start_worker(parse_slot(slot)[1], active=False)
        if self.nonce is not None:
            self.check_admission()

    def say_stopping(self) -> None:
        """Tell the coordinator this agent is done with its store (it read
        its stop, or its workers all ended): the store may close."""
        if not self.said_stopping:
            self.channel.put(P.stopping_key(self.node), time=time.time())
            self.said_stopping = True

    def stop_leftovers(self) -> None:
        """A drained node's workers still running after the grace: SIGTERM,
        then, one grace later, SIGKILL (a spare that saves on SIGTERM, a
        stuck one), so that the agent always ends."""
        self.leave_signals += 1
        self.leaving_by = time.monotonic() + LEAVE_GRACE_S
        for proc in self.workers.values():
            proc.terminate() if self.leave_signals == 1 else proc.kill()

    def check_admission(self) -> None:
        """A joining node waits for the coordinator's answer; refused, it stops."""
        answer = self.channel.get(P.admission_key(self.nonce))
        if answer is None:
            return
        self.nonce = None
        if not answer["accepted"]:
            self.refused = answer["reason"]
            print(f"deadpool-launch --join: refused: {self.refused}", file=sys.stderr, flush=True)
            self.said_stopping = True  # its index may be a live node's: not this agent's word
            self.obey({"kind": Command.STOP})

    def obey(self, command: dict) -> None:
        kind = Command(command.get("kind"))
        if kind == Command.KILL and command.get("slot") in self.workers:
            self.workers[command["slot"]].kill()
            self.workers[command["slot"]].send_signal(signal.SIGCONT)  # a stopped one too
        elif kind == Command.LEAVE and self.leaving_by is None:
            print(
                f"deadpool agent {self.node}: drained, leaving the job", file=sys.stderr, flush=True
            )
            self.leaving_by = time.monotonic() + LEAVE_GRACE_S
        elif kind == Command.STOP:
            self.stopping = True
            for proc in self.workers.values():
                proc.terminate()
        elif kind == Command.KILL_ALL:  # the node was declared lost: fenced
            self.fenced("its workers are killed")
            self.kill_workers()

    def fenced(self, how: str) -> None:
        if not self.declared_lost:
            print(
                f"deadpool agent {self.node}: the coordinator declared this node lost; "
                f"{how} and it leaves the job (rejoin with --join)",
                file=sys.stderr,
                flush=True,
            )
        self.declared_lost = True

    def kill_workers(self) -> None:
        for proc in self.workers.values():
            proc.kill()

    def run(self) -> int:
        try:
            return self.run_workers()
        finally:
            if self.zygote is not None:
                self.zygote.close()

    def run_workers(self) -> int:
        store_gone = False
        try:
            self.start()
            while self.workers:
                try:
                    self.serve()
                except dist.DistError:
                    # The coordinator is gone. After its stop command that is
                    # the normal end of the job; else a standby may take over.
                    if self.stopping or not self.fail_over():
                        store_gone = True
                        break
        except dist.DistError:  # lost while starting, and no standby took over
            self.kill_workers()
            return ExitCode.COORDINATOR_LOST
        finally:
            shutil.rmtree(self.error_dir, ignore_errors=True)
        if self.workers:  # the job is gone: leave no orphans
            self.kill_workers()
            return ExitCode.OK if self.stopping else ExitCode.COORDINATOR_LOST
        if not store_gone and not self.declared_lost:  # a fenced node's store may be cut off
            try:
                self.say_stopping()  # its workers ended before its stop came
            except dist.DistError:
                pass  # the store went meanwhile: nobody waits for the word
        codes = self.exit_codes
        if codes and all(code == ExitCode.FENCED for code in codes.values()):
            self.fenced("its workers read it in a decision")  # before its KILL_ALL came
        if self.declared_lost:
            return ExitCode.FENCED
        return ExitCode.USAGE if self.refused else ExitCode.OK

    def serve(self) -> None:
        while self.workers:
            self.beat_when_due()
            self.watch_once()
            self.check_gpus()
            self.check_slurm()
            time.sleep(0.02)

    def fail_over(self) -> bool:
        """Vote for the standby's takeover and go on with it as the
        coordinator, or with the primary if it answers first and no vote was
        cast (this host's line to both was cut, and is healed); False if
        there is no standby or neither did."""
        if self.standby is None or self.channel.address == P.host_port(self.standby):
            return False  # none holds the copy, or its copy fell behind
        try:
            channel = next_coordinator(
                self.channel,
                P.host_port(self.standby),
                self.takeover_wait_s,
                vote=P.LostPrimary(node=self.node),
            )
        except JobEnded:
            self.stopping = True  # its stop command was on its way
            return False
        if channel is None:
            return False
        if channel is self.channel:
            self.say(f"the coordinator at {self.store_addr} answers again")
            return True
        self.say(f"the coordinator moved to the standby at {self.standby}")
        self.channel, self.store_addr = channel, self.standby
        self.commands = channel.reader(P.agent_topic(self.node))
        return True

    def say(self, what: str) -> None:
        print(f"deadpool agent {self.node}: {what}", file=sys.stderr, flush=True)


def open_nvml(node: int) -> Optional[NvmlReader]:
    """NVML for the GPU health checks, or None with a line saying why not."""
    try:
        return NvmlReader.open()
    except NvmlUnavailable as why:
        print(f"deadpool agent {node}: GPU health not checked ({why})", file=sys.stderr, flush=True)
        return None


def main(command: Optional[List[str]] = None) -> int:
    """``command``: the workers' (else this process's ``--command``)."""
    if command is None:
        command = json.loads(sys.argv[sys.argv.index("--command") + 1])
    zygote = None
    if forks_workers():
        # First: forked before this process connects anywhere or starts a
        # thread, the zygote inherits only the imports (see Zygote.fork).
        zygote = Zygote.fork(command)
        if zygote is None:  # the zygote after its agent hung up, or a worker whose script returned
            return ExitCode.OK
    settings = json.loads(os.environ[P.AGENT_ENV])
    host, port = settings["store"].rsplit(":", 1)
    cut_off_s = settings.get("cut_off", CONTROL_SILENCE_S)
    timeout_s = settings.get("connect_timeout", 120)
    store = control_connect(host, int(port), timeout_s=timeout_s, cut_off_s=cut_off_s)
    agent = Agent(
        Channel(store, job_secret(), address=(host, int(port)), cut_off_s=cut_off_s),
        settings["node"],
        settings["nproc"],
        settings["active"],
        settings["world_size"],
        command,
        settings["store"],
        join=settings.get("join", False),
        standby_store=settings.get("standby_store"),
        first_standby=settings.get("first_standby"),
        takeover_wait_s=settings.get("takeover_wait", 0.0),
        zygote=zygote,
        scratch=settings.get("scratch"),
        gpus=open_nvml(settings["node"]),
        slurm_node=slurm_state.own_node(os.environ),
    )
    signal.signal(signal.SIGTERM, lambda *_: agent.obey({"kind": Command.STOP}))
    threading.current_thread().name = f"deadpool-agent-{settings['node']}"
    leave(agent.run())


if __name__ == "__main__":
    sys.exit(main())
