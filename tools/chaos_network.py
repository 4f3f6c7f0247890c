"""The faults of ``tools/chaos.py --target network``: of the network, not of processes.

Each trial takes the campaign's draw (topology, model, mirror mode) as it
is, and runs it across emulated hosts (tools/hosts.py): node 0 (the store
and the coordinator), node 1 (the standby) and the spare node each in a
network namespace of its own, one deadpool-launch per host as on a cluster.
It draws a fault of the network instead of a death: its kind, its host (0,
1 or the spare's), the iteration it comes in and its length or rate:

  * ``isolate`` / ``isolate-loud``: every packet of the host dropped at the
    switch (the sender sees nothing) / its link down; healed once the job
    recovered (or, with nothing to recover, after the timeouts ran out);
  * ``flap-short`` / ``flap-long``: the host cut for 0.2-0.45 / 1.5-3
    heartbeat timeouts, then healed by itself;
  * ``lose``: 1-5% of the host's packets dropped, both ways, to the end;
  * ``slow``: the host's link at 20-50 Mbit/s (tbf), to the end.

What the design says, checked for every trial: the job ends (no hang) with
every live node's launcher at 0; the curve and every rank's final state
equal the failure-free run's bit for bit (a hot swap where a node was lost,
nothing otherwise: what a fenced node said is never taken); a node is
declared lost only for an isolation or a flap longer than the timeout (node
0's too: the others' lines to it are then cut off, and they come over to the
standby); and each generation's failures and decisions come from one
coordinator (one term).

Here: the fault drawn, brought on the lab's hosts, and the checks of the
network; tools/chaos.py runs the trial (its job, reference and swap check).
"""

import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from deadpool_ext.defaults import CONTROL_SILENCE_S
from deadpool_ext.events import read_events
from tools import hosts

KINDS = ["isolate", "isolate-loud", "flap-short", "flap-long", "lose", "slow"]
PORT = 29500


@dataclass(frozen=True)
class NetworkFault:
    kind: str
    host: int  # 0: the coordinator's, 1: the standby's, 2: the spare node's
    iteration: int  # comes once this iteration is logged
    timeout_s: float  # the job's --deadpool-heartbeat-timeout
    amount: float = 0.0  # seconds (flap), percent (lose) or Mbit/s (slow)

    @property
    def declares_a_loss(self) -> bool:
        """Whether the design declares the host's node lost: cut for longer
        than the heartbeat timeout (node 0's too: the others' lines to it are
        cut off after the timeout, and they come over to the standby)."""
        if self.kind in ("isolate", "isolate-loud"):
            return True
        return self.kind == "flap-long" and self.amount > self.timeout_s

    def describe(self) -> str:
        unit = {"flap-short": " s", "flap-long": " s", "lose": "%", "slow": " Mbit/s"}
        amount = f" {self.amount:g}{unit[self.kind]}" if self.kind in unit else ""
        return f"{self.kind}{amount} host {self.host} iter={self.iteration}"


def draw_fault(seed: int, index: int, hosts_count: int, iters: int, timeout_s: float):
    rng = random.Random(f"network:{seed}:{index}")
    kind, host, iteration = (
        rng.choice(KINDS),
        rng.randrange(hosts_count),
        rng.randrange(2, iters - 4),
    )
    amount = {
        "flap-short": round(rng.uniform(0.2, 0.45) * timeout_s, 1),
        "flap-long": round(rng.uniform(1.5, 3.0) * timeout_s, 1),
        "lose": rng.randrange(1, 6),
        "slow": rng.randrange(20, 51),
    }.get(kind, 0.0)
    return NetworkFault(kind, host, iteration, timeout_s, amount)


def launchers(lab: hosts.Lab, nnodes: int, per_node: int, script: List[str]) -> List[List[str]]:
    """One deadpool-launch per host, node N on host N, the last the spare
    node: node 0 at host 0's address, the standby at host 1's."""
    sizes = ["--nnodes", str(nnodes), "--spare-nodes", "1", "--nproc-per-node", str(per_node)]
    where = ["--master-addr", lab.hosts[0].address, "--master-port", str(PORT)]
    where += ["--standby-addr", lab.hosts[1].address]
    launcher = [sys.executable, "-m", "deadpool_ext.launch", *sizes, *where]
    return [[*launcher, "--node-rank", str(n), *script] for n in range(nnodes + 1)]


def read(path: str) -> List[dict]:
    return read_events(path) if os.path.exists(path) else []


def may_heal(out: str, since: float, fault: NetworkFault) -> Callable[[], bool]:
    """When an isolated host may heal: the job recovered from its loss, or
    (nothing to recover: the spare's host) every timeout ran out. Node 0's
    loss is found by the agents after the timeout, and the standby's
    takeover and the swap come after: healed sooner, the partition was a
    short one (nobody lost, which the check would count as a miss)."""
    events = os.path.join(out, "events.jsonl")
    wait_s = CONTROL_SILENCE_S + 3 * fault.timeout_s

    def done() -> bool:
        if any(e["event"] == "recovered" and e["rank"] == -1 for e in read(events)):
            return True
        return time.monotonic() - since > wait_s

    return done


def bring(lab: hosts.Lab, fault: NetworkFault, out: str, limit_s: float) -> None:
    """The fault, once its iteration is logged; an isolation healed later."""
    metrics = os.path.join(out, "metrics.jsonl")
    if not hosts.wait_until(lambda: len(read(metrics)) >= fault.iteration, limit_s):
        return  # the job ended (or hung) first: the checks say which
    if fault.kind in ("isolate", "isolate-loud"):
        lab.isolate(fault.host, loud=fault.kind == "isolate-loud")
        hosts.wait_until(may_heal(out, time.monotonic(), fault), limit_s)
        lab.heal(fault.host)
    elif fault.kind.startswith("flap"):
        lab.flap(fault.host, fault.amount)
    elif fault.kind == "lose":
        lab.lose(fault.host, int(fault.amount))
    else:
        lab.slow(fault.host, fault.amount)


def one_writer_per_generation(events: List[dict]) -> bool:
    """Every generation's failures and decisions come from one coordinator
    (one term; every coordinator event carries its term): never two deciding."""
    writers: Dict[int, set] = {}
    for e in events:
        if e["rank"] == -1 and e["event"] in ("failure_detected", "decision", "abort"):
            writers.setdefault(e["gen"], set()).add(e["term"])
    return all(len(terms) == 1 for terms in writers.values())


def network_problem(fault: NetworkFault, events: List[dict], codes: List[int]) -> Optional[str]:
    """What the network's checks find wrong (None: nothing): two writers in
    a generation, a live node's launcher not ending well, a false loss, or
    a cut-off member never declared lost."""
    if not one_writer_per_generation(events):
        return "two coordinators decided in one generation"
    if any(code for node, code in enumerate(codes) if node != fault.host):
        return f"launchers exited {codes}"
    detected = [e for e in events if e["event"] == "failure_detected" and e["rank"] == -1]
    if detected and not fault.declares_a_loss:
        return f"a false loss: {detected[0]['reason']}"
    members = len(codes) - 1  # the last host is the spare node's
    if fault.declares_a_loss and fault.host < members and not detected:
        return "the cut-off node was never declared lost"
    return None
