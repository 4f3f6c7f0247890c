"""Recovery from a lost node, side by side on the demo workload (TP2 PP2 DP2
on two emulated 4-rank nodes), in one run:

  (a) hot swap: deadpool-launch with one warm spare node, node 1 killed in
      iteration --fail-at;
  (b) checkpoint-restart, Megatron style: torchrun with --save every
      --save-interval iterations; the same node's four ranks are SIGKILLed at
      the same point, the job fails, and is started again at once (as a
      scheduler's requeue would, minus the queue) with --load: every process
      restarts and training resumes from the last checkpoint. (torchrun's
      own --max-restarts cannot restart gloo jobs here: the new attempt
      reads the old attempt's gloo addresses from the store and fails.)
  (c) failure-free, through deadpool-launch;
  (d) shrink: deadpool-launch with no spare node, the same node killed at
      the same point; the job goes on as DP1 (``tools/bench_shrink.py``,
      which also runs a trace of several failures against checkpoint-restart).

Reported: time from the failure to the first completed iteration after it
(with the hot swap's breakdown), time until the job is back at the
iteration it was in, iterations lost (redone), and total time to finish.

    python -m tools.bench_recovery [--iters 40] [--fail-at 25] [--save-interval 10] [--moe]

``--moe`` runs the same four on the demo made a mixture of experts
(``bench_common.MOE_FLAGS``): the MoE row of docs/benchmarks.md.
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import time

from deadpool_ext.events import read_events
from tools.bench_common import (
    checkpoint_restart_command,
    MetricsWatch,
    demo_workload,
    launcher,
    one_shrink,
    print_shrink,
    run,
    worker_pids,
)
from tools.recovery_timeline import recoveries, stage_seconds

NODE_RANKS = (4, 5, 6, 7)  # node 1 of two 4-rank nodes


def hot_swap(opts, workdir: str, fault: bool) -> dict:
    events = os.path.join(workdir, "events.jsonl")
    args = demo_workload(opts.iters, workdir, opts.moe)
    args += ["--deadpool", "--deadpool-events", events]
    if fault:
        args.append(f"--deadpool-inject=kill:node=1:iter={opts.fail_at}")
    watch = MetricsWatch(os.path.join(workdir, "metrics.jsonl"))
    total = run(launcher(args, spare_nodes=1), watch)
    result = {"total_s": total}
    if fault:
        record = recoveries(read_events(events))[0]
        failed = record["marks"]["fault"]
        result.update(
            to_first_iteration_s=record["marks"]["first_iteration_after_recovery"] - failed,
            back_at_failed_iteration_s=watch.first_after(failed, opts.fail_at) - failed,
            iterations_lost=opts.fail_at - 1 - record["rollback_to"],
            breakdown_ms={label: round(s * 1e3) for label, s in stage_seconds(record)},
        )
    return result


def checkpoint_restart(opts, workdir: str) -> dict:
    command = checkpoint_restart_command(
        demo_workload(opts.iters, workdir, opts.moe), workdir, opts.save_interval
    )
    watch = MetricsWatch(os.path.join(workdir, "metrics.jsonl"))
    killed = []

    def kill_node(torchrun) -> None:
        done = [i for _, i in watch.seen]
        if not killed and done and done[-1] >= opts.fail_at - 1:
            time.sleep(0.3)  # into iteration fail_at, like the injected kill
            pids = worker_pids(torchrun.pid)
            killed.append(time.time())
            for rank in NODE_RANKS:
                os.kill(pids[rank], signal.SIGKILL)

    total = run(command, watch, kill_node, check=False)
    total += run(command, watch)  # the restarted job
    failed = killed[0]
    last_saved = (opts.fail_at - 1) // opts.save_interval * opts.save_interval
    return {
        "total_s": total,
        "to_first_iteration_s": watch.first_after(failed) - failed,
        "back_at_failed_iteration_s": watch.first_after(failed, opts.fail_at) - failed,
        "iterations_lost": opts.fail_at - 1 - last_saved,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--fail-at", type=int, default=25)
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--output", help="Also write the results as JSON here.")
    p.add_argument("--moe", action="store_true", help="The demo's model with MoE layers.")
    p.add_argument(
        "--only",
        nargs="+",
        choices=["failure_free", "hot_swap", "checkpoint_restart", "shrink"],
        help="A subset.",
    )
    opts = p.parse_args(argv)
    results = {}
    runs = [
        ("failure_free", lambda d: hot_swap(opts, d, fault=False)),
        ("hot_swap", lambda d: hot_swap(opts, d, fault=True)),
        ("checkpoint_restart", lambda d: checkpoint_restart(opts, d)),
        ("shrink", lambda d: one_shrink(opts, d)),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in runs:
            if opts.only and name not in opts.only:
                continue
            workdir = os.path.join(tmp, name)
            os.makedirs(workdir)
            results[name] = fn(workdir)
            print(name, json.dumps(results[name]), flush=True)
    if len(results) < len(runs):
        return 0
    hs, cr = results["hot_swap"], results["checkpoint_restart"]
    print(
        f"\nfailure -> first iteration: hot swap {hs['to_first_iteration_s']:.2f} s, "
        f"checkpoint-restart {cr['to_first_iteration_s']:.2f} s "
        f"({cr['to_first_iteration_s'] / hs['to_first_iteration_s']:.1f}x)"
    )
    print(
        f"failure -> back at iteration {opts.fail_at}: hot swap "
        f"{hs['back_at_failed_iteration_s']:.2f} s, checkpoint-restart "
        f"{cr['back_at_failed_iteration_s']:.2f} s "
        f"({cr['back_at_failed_iteration_s'] / hs['back_at_failed_iteration_s']:.1f}x)"
    )
    print(
        f"iterations lost: hot swap {hs['iterations_lost']}, checkpoint-restart "
        f"{cr['iterations_lost']}; total time: failure-free "
        f"{results['failure_free']['total_s']:.1f} s, hot swap {hs['total_s']:.1f} s, "
        f"checkpoint-restart {cr['total_s']:.1f} s"
    )
    print_shrink(results["shrink"])
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump({"options": vars(opts), **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
