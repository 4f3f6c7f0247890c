"""Fault injection for tests and demos: ``--deadpool-inject SPEC`` (repeatable).

    kill:rank=5:iter=7:phase=backward   SIGKILL rank 5 in iteration 7's backward
    kill:node=1:iter=4                  SIGKILL every process of node 1 (its agent too)
                                        at the start of iteration 4
    hang:rank=2:iter=6                  SIGSTOP rank 2 (a hang: only heartbeats notice)
    stall:rank=1:iter=4:phase=backward  rank 1's main thread stops for good in iteration
                                        4's backward while its heartbeat thread beats on
                                        (stuck where no release reaches, as in a driver
                                        call: the coordinator kills it once a failure
                                        is announced and it still trains)
    kill:rank=3:iter=5:phase=backward:delay=40
                                        SIGKILL rank 3 40 ms after it entered iteration
                                        5's backward, wherever it is by then
    kill:rank=1:iter=4:phase=save:delay=20
                                        SIGKILL rank 1 20 ms into the checkpoint save
                                        that ends iteration 4
    kill-agent:node=1:iter=4            SIGKILL node 1's agent alone at the start of
                                        iteration 4 (its workers must die with it)
    kill-launcher:node=0:iter=4         SIGKILL node 0's launcher alone (the coordinator;
                                        node 1's: the standby) at the start of iteration
                                        4, with one launcher per node: its agent and
                                        workers go on (with --standalone it is every
                                        emulated node's launcher: the job ends)
    pause-launcher:rank=0:iter=4:seconds=20
                                        rank 0 SIGSTOPs its node's launcher (node 0's: the
                                        store and the coordinator; with --standalone, every
                                        emulated node's) in iteration 4's forward and
                                        SIGCONTs it 20 s later, as a host under memory
                                        pressure or a paused VM: agents and workers go on
                                        as far as they can without the store
    oom:rank=2:iter=4:phase=backward    rank 2's step raises torch.OutOfMemoryError in iteration
                                        4's backward: a local failure, the process lives until it
                                        reports itself (exit code LOCAL_FAILURE) and is replaced
    nan:rank=1:iter=4                   rank 1's forward output turns NaN once in iteration
                                        4 (a transient fault: a rollback redoes it cleanly)
    nan-always:rank=1:iter=4            ... each time iteration 4 runs (a persistent one)
    disk-full:rank=0:iter=4             every file write of rank 0 fails (EFBIG, as on
                                        a full disk) while it saves the checkpoint that
                                        ends iteration 4 (--save-interval must make one)
    flip:rank=2:iter=5:target=param:bit=30
                                        silent data corruption: one bit of one element,
                                        drawn from seed=S (default 0) with the rank and
                                        the iteration (bit too, unless given), flips in
                                        rank 2's memory, where the target lies and when:
                                          param      a parameter at rest, after iteration
                                                     5's step (its all-gather) ended
                                          grad       a gradient before iteration 5's
                                                     reduction
                                          optimizer  the shard (main parameter or Adam's
                                                     moments) after iteration 5's update,
                                                     before the all-gather
                                          mirror     the owner's replica this rank holds,
                                                     in iteration 5's forward
    drain:node=1:iter=4                 a planned event, not a fault: at the start of
                                        iteration 4 node 1's ranks ask the coordinator to
                                        drain their node, as deadpool-ctl drain 1 does
                                        (signed with the job's secret, on the same topic)
    slow:node=1:iter=10:factor=3        a straggler: from iteration 10 on, node 1's ranks
                                        (or rank=R's) compute 3 times as long (each sleeps
                                        the difference at the end of its backward); a spare
                                        that takes their place is not slowed
    slow-warm:node=2:gen=1              spares slow to warm up: node 2's spares say they are
                                        ready only once generation 1 (the one after the first
                                        failure) trains, so that failure finds them warming
                                        (with --deadpool-spare-wait 0 the job shrinks, then
                                        grows back onto them); the one spec spares obey

Phases: forward (default), backward, grad-reduce, optimizer (after the
shard update, before the parameter all-gather), mirror (in the mirror's
exchange), save (as the checkpoint save after iteration ``iter`` begins;
disk-full's only phase), recovery (after reporting to the coordinator,
before its decision; ``iter`` is then ignored). A spec fires once per job: only in the
process that held the rank from the start, never in a spare that replaced it
(the spare redoes the iteration and must not die again).

Faults in the training phases fire once the iteration's starting snapshot
has reached the buddy (its exchange takes the first milliseconds of the
iteration), so a run redoes exactly the interrupted iteration. phase=mirror
kills inside that exchange, the one window where the buddy still holds the
snapshot of the iteration before, and one more iteration is redone.
``delay=MS`` fires from a timer thread while the rank goes on, so the
fault lands anywhere in or after the phase (the fault campaign draws it).
"""

import contextlib
import os
import resource
import signal
import threading
from dataclasses import dataclass
from typing import List, Optional

from deadpool_ext.protocol import WorkerEnv

PHASES = ("forward", "backward", "grad-reduce", "optimizer", "mirror", "save", "recovery")
ACTIONS = (
    "kill",
    "kill-agent",
    "kill-launcher",
    "pause-launcher",
    "hang",
    "stall",
    "oom",
    "nan",
    "nan-always",
    "disk-full",
    "flip",
    "slow",
    "slow-warm",
    "drain",
)
FLIP_TARGETS = ("param", "grad", "optimizer", "mirror")
# Where each flip target fires (a point FaultHook passes).
FLIP_POINTS = {
    "param": "after-step",
    "grad": "grad-reduce",
    "optimizer": "optimizer",
    "mirror": "forward",
}
# Faults that poison the forward output rather than fire at a point.
POISONS = ("nan", "nan-always")
# Where a stall stops the main thread (mirror runs in its own thread).
STALL_PHASES = ("forward", "backward", "grad-reduce", "optimizer")


class InjectError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    action: str
    rank: Optional[int]
    node: Optional[int]
    iteration: Optional[int]
    phase: str
    delay_ms: int = 0
    target: Optional[str] = None  # flip's
    bit: Optional[int] = None  # flip's, else drawn
    seed: int = 0  # flip's draw of the element (and bit)
    factor: float = 1.0  # slow's
    generation: Optional[int] = None  # slow-warm's: its spares are ready once it trains
    seconds: float = 0.0  # pause-launcher's

    def targets(self, rank: int, node: int) -> bool:
        return self.rank == rank if self.rank is not None else self.node == node

    @property
    def point(self) -> str:
        """A whole node dies at the start of the iteration, once all its ranks
        are there (in forward, pipeline stages would wait on each other); a
        poison acts on the forward's output."""
        if self.action in POISONS:
            return "output"
        if self.action == "flip":
            return FLIP_POINTS[self.target]
        return "start" if self.node is not None and self.phase == "forward" else self.phase

    @property
    def persistent(self) -> bool:
        """Due again each time its iteration runs (a rollback redoes it)."""
        return self.action == "nan-always"


def parse_fault(spec: str) -> Fault:
    parts = spec.split(":")
    action = parts[0]
    if action not in ACTIONS:
        raise InjectError(
            f"--deadpool-inject {spec}: the action must be one of {', '.join(ACTIONS)}"
        )
    if action == "flip":
        return parse_flip(spec, parts[1:])
    if action == "slow":
        return parse_slow(spec, parts[1:])
    if action == "slow-warm":
        return parse_slow_warm(spec, parts[1:])
    if action == "pause-launcher":
        return parse_pause_launcher(spec, parts[1:])
    keys = {"rank": "N", "node": "N", "iter": "N", "phase": "NAME", "delay": "MS"}
    fields = spec_fields(spec, parts[1:], keys)
    if ("rank" in fields) == ("node" in fields):
        raise InjectError(f"--deadpool-inject {spec}: name exactly one of rank=N or node=N")
    phase = fields.get("phase", "forward")
    if phase not in PHASES:
        raise InjectError(f"--deadpool-inject {spec}: phase must be one of {', '.join(PHASES)}")
    if phase != "recovery" and "iter" not in fields:
        raise InjectError(f"--deadpool-inject {spec}: say when, with iter=N")
    if action in ("hang", "stall", "oom", *POISONS) and "node" in fields:
        raise InjectError(f"--deadpool-inject {spec}: {action} takes rank=N")
    if action in POISONS and (phase != "forward" or "delay" in fields):
        raise InjectError(
            f"--deadpool-inject {spec}: {action} poisons the forward output: no phase or delay"
        )
    if action in ("kill-agent", "kill-launcher", "drain") and (
        "rank" in fields or phase != "forward"
    ):
        raise InjectError(
            f"--deadpool-inject {spec}: {action} takes node=N and iter=N (at the start "
            "of that iteration)"
        )
    if action == "disk-full":
        phase = fields.setdefault("phase", "save")
        if "node" in fields or phase != "save" or "delay" in fields:
            raise InjectError(
                f"--deadpool-inject {spec}: disk-full takes rank=N and iter=N only "
                "(it lasts the checkpoint save that ends iteration N)"
            )
    if action in ("stall", "oom") and (phase not in STALL_PHASES or "delay" in fields):
        raise InjectError(
            f"--deadpool-inject {spec}: {action} acts in the main thread: phase "
            f"must be one of {', '.join(STALL_PHASES)}, without delay"
        )
    if not all(v.isdigit() for k, v in fields.items() if k != "phase"):
        raise InjectError(
            f"--deadpool-inject {spec}: rank, node, iter and delay are integers >= 0 (digits only)"
        )
    number = {k: int(v) for k, v in fields.items() if k != "phase"}
    if number.get("iter") == 0:
        raise InjectError(f"--deadpool-inject {spec}: iterations count from 1: iter=0 never comes")
    return Fault(
        action,
        number.get("rank"),
        number.get("node"),
        number.get("iter"),
        phase,
        number.get("delay", 0),
    )


def spec_fields(spec: str, parts: List[str], keys: dict) -> dict:
    """key=value parts, each key one of ``keys`` (key: what its value is), once."""
    fields = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in keys or not value or key in fields:
            said = [f"{k}={v}" for k, v in keys.items()]
            raise InjectError(
                f"--deadpool-inject {spec}: '{part}' is not {', '.join(said[:-1])} or "
                f"{said[-1]} (each once)"
            )
        fields[key] = value
    return fields


def parse_flip(spec: str, parts: List[str]) -> Fault:
    keys = {"rank": "N", "iter": "N", "target": "NAME", "bit": "N", "seed": "N"}
    fields = spec_fields(spec, parts, keys)
    if not {"rank", "iter", "target"} <= set(fields):
        raise InjectError(f"--deadpool-inject {spec}: flip takes rank=N, iter=N and target=NAME")
    if fields["target"] not in FLIP_TARGETS:
        raise InjectError(
            f"--deadpool-inject {spec}: target must be one of {', '.join(FLIP_TARGETS)}"
        )
    if not all(v.isdigit() for k, v in fields.items() if k != "target"):
        raise InjectError(f"--deadpool-inject {spec}: rank, iter, bit and seed are integers >= 0")
    number = {k: int(v) for k, v in fields.items() if k != "target"}
    if number["iter"] == 0:
        raise InjectError(f"--deadpool-inject {spec}: iterations count from 1: iter=0 never comes")
    return Fault(
        "flip",
        number["rank"],
        None,
        number["iter"],
        FLIP_POINTS[fields["target"]],
        target=fields["target"],
        bit=number.get("bit"),
        seed=number.get("seed", 0),
    )


def parse_slow(spec: str, parts: List[str]) -> Fault:
    fields = spec_fields(spec, parts, {"rank": "N", "node": "N", "iter": "N", "factor": "F"})
    if ("rank" in fields) == ("node" in fields) or not {"iter", "factor"} <= set(fields):
        raise InjectError(
            f"--deadpool-inject {spec}: slow takes node=N (or rank=N), iter=N and factor=F"
        )
    try:
        factor = float(fields.pop("factor"))
    except ValueError:
        factor = 0.0
    if not factor > 1 or not all(v.isdigit() for v in fields.values()):
        raise InjectError(
            f"--deadpool-inject {spec}: factor is a number > 1; rank, node and iter are integers"
        )
    number = {k: int(v) for k, v in fields.items()}
    if number["iter"] == 0:
        raise InjectError(f"--deadpool-inject {spec}: iterations count from 1: iter=0 never comes")
    return Fault(
        "slow", number.get("rank"), number.get("node"), number["iter"], "grad-reduce", factor=factor
    )


def parse_slow_warm(spec: str, parts: List[str]) -> Fault:
    fields = spec_fields(spec, parts, {"node": "N", "gen": "G"})
    if set(fields) != {"node", "gen"} or not all(v.isdigit() for v in fields.values()):
        raise InjectError(
            f"--deadpool-inject {spec}: slow-warm takes node=N and gen=G (integers: the "
            "spare node, and the generation its spares wait for)"
        )
    if int(fields["gen"]) < 1:
        raise InjectError(
            f"--deadpool-inject {spec}: generation 0 is the job's start: gen=G is 1 or more"
        )
    return Fault(
        "slow-warm", None, int(fields["node"]), None, "warm-up", generation=int(fields["gen"])
    )


def parse_pause_launcher(spec: str, parts: List[str]) -> Fault:
    fields = spec_fields(spec, parts, {"rank": "N", "iter": "N", "seconds": "S"})
    try:
        seconds = float(fields.pop("seconds", "nan"))
    except ValueError:
        seconds = float("nan")
    if set(fields) != {"rank", "iter"} or not all(v.isdigit() for v in fields.values()):
        raise InjectError(
            f"--deadpool-inject {spec}: pause-launcher takes rank=N, iter=N and seconds=S"
        )
    if not seconds > 0 or int(fields["iter"]) == 0:
        raise InjectError(
            f"--deadpool-inject {spec}: seconds is a number > 0 and iter=N counts from 1"
        )
    return Fault(
        "pause-launcher", int(fields["rank"]), None, int(fields["iter"]), "forward", seconds=seconds
    )


def spares_ready_at(faults: List[Fault], node: int) -> Optional[int]:
    """The generation whose training this node's spares wait for before they
    say they are ready (slow-warm), or None: they say so once warm."""
    held = [f.generation for f in faults if f.action == "slow-warm" and f.node == node]
    return max(held, default=None)


def parse_faults(specs: Optional[List[str]]) -> List[Fault]:
    return [parse_fault(spec) for spec in specs or []]


class Injector:
    """The faults aimed at this process, each due once; one per process, so
    a fault that fired stays fired when a shrink rebuilds the trainer."""

    def __init__(self, faults: List[Fault], rank: Optional[int], node: int, original: bool):
        self.faults = [f for f in faults if original and f.targets(rank, node)]
        self.fired = set()
        self.slowed = False  # a slowdown began (said once)

    def slowdown(self, iteration: int) -> float:
        """How many times as long this process computes in ``iteration``."""
        factors = [f.factor for f in self.slowdowns() if iteration >= f.iteration]
        return max(factors, default=1.0)

    def slowdowns(self) -> List[Fault]:
        return [f for f in self.faults if f.action == "slow"]

    def slow_fault(self) -> Fault:
        return self.slowdowns()[0]

    def due(self, phase: str, iteration: Optional[int] = None) -> List[Fault]:
        """The faults whose point this is and that have not fired yet. The
        caller marks each one fired when it fires it: a rank that fails on a
        peer's death before it gets there (the wait for its snapshot) meets
        the fault again when it redoes the iteration."""
        return [
            fault
            for fault in self.faults
            if fault not in self.fired
            and fault.point == phase
            and fault.action != "slow"  # lasts: FaultHook.slow_down
            and (phase == "recovery" or fault.iteration == iteration)
        ]


def fire(fault: Fault) -> None:
    if fault.action == "disk-full":
        fill_disk()
    elif fault.action == "oom":
        import torch  # only a rank fires faults; parsing their specs needs no torch

        raise torch.OutOfMemoryError(
            "injected: CUDA out of memory (--deadpool-inject oom): this rank's own failure"
        )
    elif fault.action == "stall":
        threading.Event().wait()  # forever; only a kill ends it
    elif fault.action == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "kill-agent":
        # Every worker of the node fires this; the first kill is the one.
        # The workers die of the parent-death signal their agent's death sends.
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent_pid(), signal.SIGKILL)
    elif fault.action == "kill-launcher":
        with contextlib.suppress(ProcessLookupError):
            os.kill(parent_of(agent_pid()), signal.SIGKILL)
    elif fault.action == "pause-launcher":
        pause(parent_of(agent_pid()), fault.seconds)
    elif fault.node is not None:
        # The agent started this node's workers in its own process group.
        os.killpg(os.getpgrp(), signal.SIGKILL)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def pause(pid: int, seconds: float) -> None:
    """SIGSTOP ``pid`` now and SIGCONT it ``seconds`` later, from a thread
    of this process (which goes on meanwhile, as far as it can)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGSTOP)
    resume = threading.Timer(seconds, lambda: os.kill(pid, signal.SIGCONT))
    resume.daemon = True
    resume.start()


def agent_pid() -> int:
    """This worker's agent (its parent, or its zygote's)."""
    return WorkerEnv.read().agent_pid or os.getppid()


def parent_of(pid: int) -> int:
    """A process's parent (here: an agent's launcher), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def fill_disk() -> None:
    """From now on every write of this process past a file's first byte
    fails with EFBIG (Python ignores SIGXFSZ), as on a full disk."""
    global _file_size_limit
    _file_size_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, _file_size_limit[1]))


def free_disk() -> None:
    """Undoes fill_disk."""
    if _file_size_limit is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, _file_size_limit)


_file_size_limit = None  # the process's limit before fill_disk
