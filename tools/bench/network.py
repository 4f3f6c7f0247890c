"""What the network's faults cost, side by side in one run, across emulated
hosts (tools/hosts.py: each node's deadpool-launch in a network namespace of
its own, as on a cluster): the demo's model as TP2 x DP3 on three 2-rank
hosts and a spare host, node 1 the standby.

  (a) the time per iteration on a clean network, with 2% of host 1's packets
      lost (both ways, at the switch), and with host 1's link at 10 Mbit/s
      (tbf both ways): the median of iterations 3 to --iters, and each as a
      ratio to the clean run's;
  (b) how long a silent partition of host 2, then of host 0 (every packet
      dropped at the switch, in iteration 5), then a cut of host 2's data
      path alone (its connections to the other hosts but the stores'),
      takes to be declared a loss, for each --deadpool-heartbeat-timeout of
      --timeouts: from the cut to the coordinator's ``failure_detected``
      (host 0's: the standby's, once it took over), and as a multiple of
      the timeout.

    python -m tools.bench.network [--iters 20] [--timeouts 3 6] [--loss 2] [--mbit 10]
        [--cuts isolate-2 isolate-0 data-2] [--no-links]

Needs root and nftables (``tools/hosts.py``'s ``missing`` says what is not
there). Measured, wall time, on whatever machine runs it.
"""

import argparse
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from typing import Callable, List, Optional

from deadpool_ext.events import read_events
from deadpool_ext.protocol import STANDBY_PORT_OFFSET
from tools import hosts
from tools.bench.common import REPO, demo_args, strip_outputs
from tools.workers import worker_env

NODES, SPARES, PER_NODE, PORT = 3, 1, 2, 29500
LAYOUT = ["--pipeline-model-parallel-size", "1", "--global-batch-size", "24"]
LAYOUT += ["--log-interval", "1", "--eval-iters", "0"]


def job_args(tmp: str, iters: int, timeout: float) -> List[str]:
    data = os.path.join(REPO, "data", "corpus_text_document")
    args = strip_outputs(demo_args()) + LAYOUT + ["--train-iters", str(iters)]
    args += ["--data-path", data, "--metrics-file", os.path.join(tmp, "metrics.jsonl")]
    args += ["--deadpool", "--deadpool-events", os.path.join(tmp, "events.jsonl")]
    return args + ["--deadpool-heartbeat-timeout", str(timeout)]


def launcher(node: int, lab: hosts.Lab) -> List[str]:
    flags = ["--nnodes", str(NODES), "--spare-nodes", str(SPARES)]
    flags += ["--nproc-per-node", str(PER_NODE), "--node-rank", str(node)]
    flags += ["--master-addr", lab.hosts[0].address, "--master-port", str(PORT)]
    flags += ["--standby-addr", lab.hosts[1].address]
    return [sys.executable, "-m", "deadpool_ext.launch", *flags]


def iterations(tmp: str) -> List[dict]:
    try:
        with open(os.path.join(tmp, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def run_job(lab: hosts.Lab, tmp: str, args: List[str], at: Optional[Callable] = None) -> None:
    """One job across the lab's hosts; ``at``: (iteration, fault) called once
    that iteration is logged. Raises if a launcher fails (a fault the job
    survives ends every launcher of a live node with 0)."""
    env = dict(worker_env(), DEADPOOL_SECRET=secrets.token_hex(32))
    script = os.path.join(REPO, "pretrain_gpt.py")
    procs = []
    for node in range(NODES + SPARES):
        log = open(os.path.join(tmp, f"node{node}.log"), "w")
        command = [*launcher(node, lab), script, *args]
        procs.append(lab.start(node, command, env=env, cwd=REPO, stdout=log, stderr=log))
    if at is not None:
        iteration, fault = at
        reached = lambda: len(iterations(tmp)) >= iteration  # noqa: E731
        ended = lambda: any(proc.poll() is not None for proc in procs)  # noqa: E731
        hosts.wait_until(lambda: reached() or ended(), 600)
        if reached():
            fault()
    codes = [proc.wait(timeout=900) for proc in procs]
    if any(code not in (0, 10) for code in codes):
        raise RuntimeError(f"launchers exited {codes}: see {tmp}/node*.log")


def per_iteration(tmp: str) -> float:
    return statistics.median(m["seconds"] for m in iterations(tmp)[2:])


def link_costs(opts) -> List[str]:
    rows, clean = [], None
    for name, fault in (
        ("clean", None),
        (f"{opts.loss}% of host 1's packets lost", lambda lab: lab.lose(1, opts.loss)),
        (f"host 1's link at {opts.mbit:g} Mbit/s", lambda lab: lab.slow(1, opts.mbit)),
    ):
        tmp = tempfile.mkdtemp(prefix="bench-network-")
        with hosts.Lab(NODES + SPARES) as lab:
            if fault is not None:
                fault(lab)
            run_job(lab, tmp, job_args(tmp, opts.iters, 10))
        seconds = per_iteration(tmp)
        clean = clean or seconds
        rows.append(f"| {name} | {seconds:.3f} | {seconds / clean:.2f} |")
    return rows


STORES = (PORT, PORT + STANDBY_PORT_OFFSET)
# Name -> (the host cut, how): the faults of (b).
CUTS = {
    "isolate-2": (2, lambda lab: lab.isolate(2)),
    "isolate-0": (0, lambda lab: lab.isolate(0)),
    "data-2": (2, lambda lab: lab.cut_data(2, STORES)),
}


def detection(opts) -> List[str]:
    """Each cut of ``opts.cuts`` in iteration 5, healed once the loss was
    declared (the healed node then learns it and leaves: exit 10). Host
    0's loss (the store and the coordinator) is declared by the standby
    once it took over."""
    rows = []
    for name in opts.cuts:
        host, cut = CUTS[name]
        for timeout in opts.timeouts:
            seconds = time_to_detect(opts, host, cut, timeout)
            rows.append(f"| {name} | {timeout:g} | {seconds:.2f} | {seconds / timeout:.2f} |")
    return rows


def time_to_detect(opts, host: int, cut, timeout: float) -> float:
    tmp = tempfile.mkdtemp(prefix="bench-network-")
    events = os.path.join(tmp, "events.jsonl")
    found = lambda: [e for e in read_events(events) if e["event"] == "failure_detected"]  # noqa: E731
    with hosts.Lab(NODES + SPARES) as lab:
        cut_at = []

        def isolate_until_found():
            cut_at.append(time.time())
            cut(lab)
            hosts.wait_until(lambda: bool(found()), 300)
            lab.heal(host)

        run_job(lab, tmp, job_args(tmp, opts.iters, timeout), at=(5, isolate_until_found))
    return found()[0]["time"] - cut_at[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--timeouts", type=float, nargs="+", default=[3.0, 6.0])
    parser.add_argument("--loss", type=int, default=2)
    parser.add_argument("--mbit", type=float, default=10.0)
    parser.add_argument("--cuts", nargs="+", choices=list(CUTS), default=list(CUTS))
    parser.add_argument("--no-links", action="store_true", help="skip (a)")
    opts = parser.parse_args(argv)
    if hosts.missing() is not None:
        print(f"bench-network: {hosts.missing()}", file=sys.stderr)
        return 2
    if not opts.no_links:
        print("| network | seconds per iteration (median) | against clean |")
        print("|---|---|---|")
        for row in link_costs(opts):
            print(row, flush=True)
    print("\n| cut | heartbeat timeout (s) | cut to failure_detected (s) | in timeouts |")
    print("|---|---|---|---|")
    for row in detection(opts):
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
