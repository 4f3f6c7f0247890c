"""Shrink and grow against checkpoint-restart, side by side in one run (after
ReCoVer's comparison), on emulated nodes with no spare node:

  (a) one shrink: the demo workload (TP2·PP2·DP2 on two 4-rank nodes); node 1
      is killed in iteration --fail-at and the job goes on as DP1. Reported:
      time from the failure to the first completed iteration, iterations
      lost, and the median iteration time before and after (on hardware
      with a device per rank the throughput after is (DP-1)/DP of before;
      here all ranks share the machine's cores, see docs/benchmarks.md).
  (b) a trace of failures on the demo model as PP2·DP4 (TP1): the ranks of
      --trace are killed at their iterations. deadpool-launch shrinks at
      each (and grows back when released ranks make up a replica);
      checkpoint-restart (torchrun, --save every --save-interval) is
      restarted from its last checkpoint after each; and a failure-free run.
      Reported: wall time and effective throughput (the run's tokens over
      its wall time) of each, relative to failure-free.

    python -m tools.bench.shrink [--iters 60] [--fail-at 20] [--trace 15:7 30:5 45:3]
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from typing import List

from tools.bench.common import (
    checkpoint_restart_command,
    MetricsWatch,
    deadpool_run,
    demo_workload,
    one_shrink,
    print_shrink,
    run,
    worker_pids,
)


def replace_flag(args: List[str], flag: str, value: str) -> List[str]:
    out = list(args)
    out[out.index(flag) + 1] = value
    return out


def trace_layout(args: List[str]) -> List[str]:
    """The demo model as TP1 x PP2 x DP4 on the same 8 ranks."""
    return replace_flag(args, "--tensor-model-parallel-size", "1")


def trace_deadpool(opts, workdir: str) -> dict:
    args = trace_layout(demo_workload(opts.iters, workdir))
    faults = [f"kill:rank={rank}:iter={it}" for it, rank in opts.trace]
    out = deadpool_run(args, workdir, faults)
    sizes = [(e["action"], e.get("dp_after")) for e in out["events"] if e["event"] == "decision"]
    return {"total_s": out["total_s"], "decisions": sizes}


def trace_checkpoint_restart(opts, workdir: str) -> dict:
    command = checkpoint_restart_command(
        trace_layout(demo_workload(opts.iters, workdir)), workdir, opts.save_interval
    )
    watch = MetricsWatch(os.path.join(workdir, "metrics.jsonl"))
    pending, total, restarts = list(opts.trace), 0.0, 0

    def kill_at_iteration(torchrun) -> None:
        done = [i for _, i in watch.seen]
        if pending and done and done[-1] >= pending[0][0] - 1:
            time.sleep(0.3)  # into the iteration, like the injected kill
            os.kill(worker_pids(torchrun.pid)[pending[0][1]], signal.SIGKILL)
            pending.pop(0)

    while True:
        before = len(pending)
        total += run(command, watch, kill_at_iteration, check=len(pending) == 0)
        if len(pending) == before:  # ran to the end
            break
        restarts += 1
    return {"total_s": total, "restarts": restarts}


def trace_failure_free(opts, workdir: str) -> dict:
    out = deadpool_run(trace_layout(demo_workload(opts.iters, workdir)), workdir, [])
    return {"total_s": out["total_s"]}


def parse_trace(items: List[str]) -> List[tuple]:
    return sorted(tuple(int(x) for x in item.split(":")) for item in items)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--fail-at", type=int, default=20)
    p.add_argument(
        "--trace",
        nargs="+",
        default=["15:7", "30:5", "45:3"],
        help="ITERATION:RANK failures for the trace (launch ranks).",
    )
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--output", help="Also write the results as JSON here.")
    p.add_argument("--only", nargs="+", choices=["shrink", "trace"], help="A part.")
    opts = p.parse_args(argv)
    opts.trace = parse_trace(opts.trace)
    runs = [
        ("shrink", one_shrink),
        ("trace_failure_free", trace_failure_free),
        ("trace_deadpool", trace_deadpool),
        ("trace_checkpoint_restart", trace_checkpoint_restart),
    ]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in runs:
            if opts.only and name.split("_")[0] not in opts.only:
                continue
            workdir = os.path.join(tmp, name)
            os.makedirs(workdir)
            results[name] = fn(opts, workdir)
            print(name, json.dumps(results[name]), flush=True)
    if "shrink" in results:
        print_shrink(results["shrink"])
    if "trace_deadpool" in results:
        print_trace(results)
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump({"options": {**vars(opts), "trace": opts.trace}, **results}, f, indent=1)
    return 0


def print_trace(results: dict) -> None:
    free = results["trace_failure_free"]["total_s"]
    for name in ("trace_deadpool", "trace_checkpoint_restart"):
        total = results[name]["total_s"]
        print(f"{name}: {total:.1f} s, effective throughput {free / total:.2f} of failure-free")
    dp, cr = results["trace_deadpool"]["total_s"], results["trace_checkpoint_restart"]["total_s"]
    print(f"deadpool / checkpoint-restart effective throughput: {cr / dp:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
