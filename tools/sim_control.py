"""The control plane at scale, on this machine: the real coordinator, store
and protocol, with simulated ranks and agents that beat, report and
acknowledge and train nothing.

    .venv/bin/python -m tools.sim_control --ranks 512 --fault node --json R.json

One process is node 0's launcher (the store's server and the coordinator
of deadpool_ext/control/coordinator.py, with its run loop); ``--procs``
processes play the nodes, each one store client for its share of them,
doing what rank/client.py's heartbeat thread and the agent do, at their
rates: a rank beats every HEARTBEAT_INTERVAL_S and reads the generation
every WATCH_S, an agent beats and reads its commands. After a warm-up the
fault comes; a survivor that reads the failure reports, waits for the
decision, joins the new generation and resumes, as a worker does; a spare
named in the decision takes its rank.

What it measures (the JSON file): the fault's times after the heartbeat
timeout expired (``detected_s``: the generation opened; ``decided_s``:
the decision published; ``read_by_all_s``: every member of the new
generation read it), the store operations per second and bytes the
simulated processes moved in the steady state (``store_ops_per_s``) against
what the protocol asks at these rates (``offered_ops_per_s``: where the
achieved rate falls short, this machine could not play every process, and
the figures above are of a slower job than the one asked), and the CPU of
node 0's launcher while training: its main thread (``coordinator_cpu``,
share of one core) and its other threads (the store's server,
``store_cpu``).

Why a simulator of our own: the coordinator's costs are those of this
code at a given size, which no general tool models; what it drives is the
real code, only the training is left out.
"""

import argparse
import heapq
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from deadpool_ext import protocol as P  # noqa: E402
from deadpool_ext.defaults import HEARTBEAT_INTERVAL_S  # noqa: E402
from deadpool_ext.protocol import CoordinatorSettings, Decision  # noqa: E402

SECRET = os.urandom(16).hex().encode()
WATCH_S = 0.05  # a rank's heartbeat thread reads the generation this often (client._beat)
AGENT_POLL_S = 0.02  # an agent's watch of its commands (agent.serve)
FAULTS = ("node", "nodes10", "straggler")


# ----- the store as the simulated processes use it, counted -----
class Counted:
    """A store whose operations and bytes are counted (``counts``: a shared
    array, [operations, bytes] at ``at``)."""

    def __init__(self, store, counts, at: int):
        self.store, self.counts, self.at = store, counts, at

    def tally(self, nbytes: int) -> None:
        self.counts[self.at] += 1
        self.counts[self.at + 1] += nbytes

    def set(self, key, value):
        self.tally(len(key) + len(value))
        return self.store.set(key, value)

    def get(self, key):
        value = self.store.get(key)
        self.tally(len(key) + len(value))
        return value

    def check(self, keys):
        self.tally(sum(map(len, keys)))
        return self.store.check(keys)

    def add(self, key, amount):
        self.tally(len(key) + 8)
        return self.store.add(key, amount)


# ----- node 0's launcher -----
def coordinator_main(port, nnodes, spares, nproc, settings, events, counts):
    from deadpool_ext.control import run_loop
    from deadpool_ext.control.coordinator import Coordinator
    from deadpool_ext.events import EventLog
    from deadpool_ext.wire import Channel, connect

    store = connect("127.0.0.1", port, timeout_s=60, is_master=True)
    channel = Channel(Counted(store, counts, 0), SECRET)
    log = EventLog(events, P.COORDINATOR_RANK)
    coordinator = Coordinator(channel, nnodes, spares, nproc, log, settings=settings)
    run_loop.run(coordinator)
    time.sleep(24 * 3600)  # an ended job's store stays for the nodes' last reads (killed)


# ----- the simulated nodes -----
@dataclass
class Sim:
    """One simulated worker: a member (``rank``) or a spare."""

    slot: str
    rank: Optional[int]
    gen: int = 0
    iteration: int = 0
    phase: str = "training"  # or reported, joining
    decided_at: Optional[float] = None


@dataclass
class Schedule:
    tp: int
    pp: int
    nproc: int
    world: int
    heartbeat_s: float = HEARTBEAT_INTERVAL_S
    watch_s: float = WATCH_S
    iteration_s: float = 1.0
    started: float = 0.0  # wall time the job started
    stop_at: float = 0.0  # wall time the run ends
    lost: List[int] = field(default_factory=list)  # nodes the fault takes
    slow: List[int] = field(default_factory=list)  # nodes the fault slows
    fault_at: float = 0.0  # wall time


def nodes_main(nodes, active_nodes, plan: Schedule, port, counts, at, results):
    from deadpool_ext.wire import Channel, connect

    store = connect("127.0.0.1", port, timeout_s=60)
    channel = Channel(Counted(store, counts, at), SECRET)
    sims: List[Sim] = []
    for node in nodes:
        for local in range(plan.nproc):
            rank = node * plan.nproc + local if node < active_nodes else None
            sims.append(Sim(f"{node}.{local}", rank))
    if any(s.rank == 0 for s in sims):
        post_plan(channel, plan)
    for s in sims:
        if s.rank is None:
            channel.post(P.COORDINATOR_TOPIC, P.SpareReady(slot=s.slot))
    readers = {n: channel.reader(P.agent_topic(n)) for n in nodes}
    results.put(run_nodes(channel, nodes, sims, readers, plan))


def post_plan(channel, plan: Schedule) -> None:
    """Rank 0's layout (--use-tp-pp-dp-mapping): each rank's buddy is its
    data-parallel peer one replica on, on another node."""
    size = plan.tp * plan.pp
    buddy = [(r + size) % plan.world for r in range(plan.world)]
    owner = [(r - size) % plan.world for r in range(plan.world)]
    channel.post(
        P.COORDINATOR_TOPIC,
        P.Plan(gen=0, buddy=buddy, owner=owner, tp=plan.tp, pp=plan.pp, tp_pp_dp=True),
    )


def run_nodes(channel, nodes, sims, readers, plan: Schedule) -> dict:
    """Every simulated process's duties by their due times until the end;
    what each member saw of the fault."""
    due = [(0.0, "agent", n) for n in nodes] + [(0.0, "beat", i) for i in range(len(sims))]
    due += [(random.random() * plan.watch_s, "watch", i) for i in range(len(sims))]
    due += [(0.0, "poll", n) for n in nodes]
    heapq.heapify(due)
    start, last_beat = time.monotonic(), {}
    late = {"before_fault": 0.0, "after_fault": 0.0}  # how far behind its duties it fell
    while time.time() < plan.stop_at:
        when, duty, who = heapq.heappop(due)
        now = time.monotonic() - start
        if when > now:
            time.sleep(when - now)
        phase = "before_fault" if time.time() < plan.fault_at else "after_fault"
        late[phase] = max(late[phase], now - when)
        node = who if duty in ("agent", "poll") else int(sims[who].slot.split(".")[0])
        if node in plan.lost and time.time() >= plan.fault_at:
            continue  # dead: nothing more from it
        if duty == "agent":
            channel.put(P.node_heartbeat_key(node), time=time.time())
            channel.get(P.GEN_KEY)
            last_beat[node] = time.time()
            heapq.heappush(due, (when + plan.heartbeat_s, duty, who))
        elif duty == "poll":
            readers[node].poll()
            heapq.heappush(due, (when + AGENT_POLL_S, duty, who))
        elif duty == "beat":
            beat(channel, sims[who], node in plan.slow and time.time() >= plan.fault_at, plan)
            heapq.heappush(due, (when + plan.heartbeat_s, duty, who))
        else:
            watch(channel, sims[who])
            heapq.heappush(due, (when + plan.watch_s, duty, who))
    return {
        "decided_at": [s.decided_at for s in sims if s.decided_at is not None],
        "members": sum(1 for s in sims if s.rank is not None and s.decided_at is not None),
        "late_s": late,
        "last_beat": {str(n): t for n, t in last_beat.items() if n in plan.lost},
    }


def beat(channel, sim: Sim, slow: bool, plan: Schedule) -> None:
    if sim.rank is None:
        state = P.WorkerState.SPARE
    else:
        state = P.WorkerState.TRAINING
        if sim.phase == "training":  # one clock for all: every rank at the same iteration
            sim.iteration = int((time.time() - plan.started) / plan.iteration_s)
    seconds = (3.0 if slow else 1.0) * plan.iteration_s
    compute = {"seconds": seconds, "count": 100, "iteration": sim.iteration}
    channel.put(
        P.worker_heartbeat_key(sim.slot),
        iteration=sim.iteration,
        state=state,
        where=P.Where.COMPUTE,
        compute=compute if sim.rank is not None else None,
    )


def watch(channel, sim: Sim) -> None:
    """A rank's heartbeat thread's read of the generation, and what its main
    thread does after a failure: report, wait for the decision, join, resume."""
    latest = channel.get(P.GEN_KEY)
    if latest is None or latest["gen"] <= sim.gen and sim.phase == "training":
        return
    gen = latest["gen"]
    if gen > sim.gen and latest["state"] == P.JobState.RECOVERING:  # again if another came
        if sim.rank is not None:
            own = [max(0, sim.iteration - 1), sim.iteration]  # its two last snapshots
            report = P.Report(rank=sim.rank, slot=sim.slot, own=own, held=own, gen=gen)
            channel.post(P.COORDINATOR_TOPIC, report)
        sim.gen, sim.phase = gen, "reported"
    if sim.phase == "reported":
        body = channel.get(P.decision_key(sim.gen))
        if body is None:
            return
        decision = Decision.from_message(body)
        sim.rank = decision.rank_of(sim.slot)
        if sim.rank is None:
            sim.phase = "training"  # a spare left as it was
            return
        sim.decided_at, sim.phase = time.time(), "joining"
        joining = P.Joining(gen=sim.gen, rank=sim.rank, slot=sim.slot)
        channel.post(P.COORDINATOR_TOPIC, joining)
    if sim.phase == "joining" and channel.get(P.join_key(sim.gen)) is not None:
        resumed = P.Resumed(gen=sim.gen, rank=sim.rank, slot=sim.slot)
        channel.post(P.COORDINATOR_TOPIC, resumed)
        sim.phase = "training"


# ----- the run -----
def lost_nodes(fault: str, nnodes: int, per_replica: int) -> List[int]:
    """The nodes a loss takes: never node 0 (the coordinator's: its own
    fault), and never two whose ranks mirror each other (a replica's
    nodes and the next replica's), so that every lost shard has a copy."""
    if fault not in ("node", "nodes10"):
        return []
    count = 1 if fault == "node" else 10
    even = [n for n in range(1, nnodes) if (n // per_replica) % 2 == 0]
    if len(even) < count or nnodes // per_replica < 2:
        raise SystemExit(f"sim_control: --fault {fault} needs more replicas: raise --ranks")
    return even[:count]


def thread_cpu(pid: int) -> Dict[str, float]:
    """CPU seconds of a process's main thread and of its other threads."""
    tick = os.sysconf("SC_CLK_TCK")
    main = rest = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        seconds = (int(fields[11]) + int(fields[12])) / tick
        main, rest = (main + seconds, rest) if int(tid) == pid else (main, rest + seconds)
    return {"main": main, "rest": rest}


def offered_ops_per_s(ranks: int, nodes: int, plan: Schedule) -> float:
    """What today's protocol asks of the store at these rates: a rank's beat
    (a put) and its read of the generation (a check and a get); an agent's
    beat and read, and its command topic's counter."""
    per_rank = 1 / plan.heartbeat_s + 2 / plan.watch_s
    per_agent = 3 / plan.heartbeat_s + 1 / AGENT_POLL_S
    return ranks * per_rank + nodes * per_agent


def simulate(args) -> dict:
    nproc, nnodes = args.ranks_per_node, args.ranks // args.ranks_per_node
    per_replica = max(1, args.tp * args.pp // nproc)
    lost = lost_nodes(args.fault, nnodes, per_replica)
    spares = max(len(lost), -(-nnodes * args.spare_percent // 100))
    settings = CoordinatorSettings(heartbeat_timeout=args.heartbeat_timeout, spare_wait=0.0)
    now = time.time()
    fault_at = now + args.warmup_s + args.steady_s
    plan = Schedule(
        args.tp,
        args.pp,
        nproc,
        args.ranks,
        started=now,
        fault_at=fault_at,
        stop_at=fault_at + args.heartbeat_timeout + args.after_s,
        lost=lost,
        slow=[nnodes - 1] if args.fault == "straggler" else [],
    )
    with tempfile.TemporaryDirectory(prefix="sim_control-") as folder:
        return play(args, plan, nnodes, spares, settings, os.path.join(folder, "events.jsonl"))


def play(args, plan: Schedule, nnodes: int, spares: int, settings, events: str) -> dict:
    """Node 0's launcher and the simulated nodes, from the start to the
    fault's aftermath; every process ended on the way out."""
    from deadpool_ext.control.ports import free_port
    from deadpool_ext.events import read_events

    port = free_port()
    ctx = mp.get_context("fork")
    counts = ctx.Array("d", 2 * (args.procs + 1), lock=False)
    results = ctx.Queue()
    every = list(range(nnodes + spares))
    shares = [every[i :: args.procs] for i in range(args.procs)]
    nproc = args.ranks_per_node
    coordinator = ctx.Process(
        target=coordinator_main, args=(port, nnodes, spares, nproc, settings, events, counts)
    )
    procs = [
        ctx.Process(target=nodes_main, args=(share, nnodes, plan, port, counts, 2 * i, results))
        for i, share in enumerate(shares, start=1)
    ]
    try:
        coordinator.start()
        time.sleep(1.0)  # its store listens
        for p in procs:
            p.start()
        time.sleep(max(0.0, plan.started + args.warmup_s - time.time()))
        before, cpu_before, t_before = list(counts), thread_cpu(coordinator.pid), time.time()
        time.sleep(max(0.0, plan.fault_at - time.time()))
        after, cpu_after, t_after = list(counts), thread_cpu(coordinator.pid), time.time()
        outcomes = [results.get(timeout=plan.stop_at - time.time() + 120) for _ in procs]
    finally:
        for p in procs + [coordinator]:
            p.kill()
            p.join(timeout=30)
    window = t_after - t_before
    simulated = sum(after[i] - before[i] for i in range(2, len(counts), 2))
    moved = sum(after[i] - before[i] for i in range(3, len(counts), 2))
    result = {
        "ranks": args.ranks,
        "nodes": nnodes,
        "spare_nodes": spares,
        "layout": f"TP{args.tp}·PP{args.pp}, {nproc} ranks per node",
        "fault": args.fault,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "procs": args.procs,
        "store_ops_per_s": round(simulated / window),
        "offered_ops_per_s": round(offered_ops_per_s(args.ranks, nnodes + spares, plan)),
        "store_bytes_per_s": round(moved / window),
        "coordinator_store_ops_per_s": round((after[0] - before[0]) / window),
        "coordinator_cpu": round((cpu_after["main"] - cpu_before["main"]) / window, 3),
        "store_cpu": round((cpu_after["rest"] - cpu_before["rest"]) / window, 3),
        # How far the simulated processes fell behind their duties: where
        # more than a heartbeat interval, this machine could not play them all.
        "late_s": round(max(o["late_s"]["before_fault"] for o in outcomes), 3),
        "late_after_fault_s": round(max(o["late_s"]["after_fault"] for o in outcomes), 3),
    }
    result.update(fault_times(read_events(events), outcomes, plan, args))
    return result


def fault_times(events: List[dict], outcomes: List[dict], plan: Schedule, args) -> dict:
    """The fault's moments, in seconds after the heartbeat timeout expired
    (a straggler's: after its compute slowed)."""
    first = {}
    for e in events:
        first.setdefault(e["event"], e)
    if args.fault == "straggler":
        found = first.get("straggler")
        return {"detected_s": None if found is None else round(found["time"] - plan.fault_at, 3)}
    beats = [t for o in outcomes for t in o["last_beat"].values()]
    expired = max(beats, default=plan.fault_at) + args.heartbeat_timeout
    read = [t for o in outcomes for t in o["decided_at"]]
    members = sum(o["members"] for o in outcomes)
    since = lambda name: (  # noqa: E731
        None if name not in first else round(first[name]["time"] - expired, 3)
    )
    detected = [e for e in events if e["event"] == "failure_detected"]
    return {
        "detected_s": since("failure_detected"),
        "decided_s": since("decision"),
        "decision": first.get("decision", {}).get("action"),
        "read_by_all_s": round(max(read) - expired, 3) if members == args.ranks else None,
        "members_read": members,
        "recovered_s": since("recovered"),
        "failures_declared": len(detected),
        "generations": sum(1 for e in events if e["event"] == "decision"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--fault", choices=FAULTS, default="node")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--spare-percent", type=int, default=5)
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--procs", type=int, default=2, help="processes playing the nodes")
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--after-s", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.ranks % args.ranks_per_node or args.ranks % (args.tp * args.pp):
        parser.error("--ranks must be a multiple of --ranks-per-node and of --tp x --pp")
    result = simulate(args)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
