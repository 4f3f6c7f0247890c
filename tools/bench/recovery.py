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
      the same point; the job goes on as DP1 (``tools/bench/shrink.py``,
      which also runs a trace of several failures against checkpoint-restart).

Reported: time from the failure to the first completed iteration after it
(with the hot swap's breakdown), time until the job is back at the
iteration it was in, iterations lost (redone), and total time to finish.

    python -m tools.bench.recovery [--iters 40] [--fail-at 25] [--save-interval 10] [--moe]

``--moe`` runs the same four on the demo made a mixture of experts
(``common.MOE_FLAGS``): the MoE row of docs/benchmarks.md.

``--scale 8 16 32`` runs only the hot swap, on the demo's model at each of
those world sizes (TP2 PP2, DP = size / 4: one replica per emulated 4-rank
node, one spare node), node 1 killed in iteration --fail-at, and reports
what the rebuild costs as the job grows: the rebuild stage, and each rank's
``groups_rebuilt`` (the groups it created, held and connected, and the
time they took), once making every group again (full rebuild) and once
only those with a replaced member (``--deadpool-rebuild-groups changed``,
partial rebuild). After each size,
the groups' floor: one group's cost to a rank on that many gloo processes
with nothing else running, the constants of docs/scale.md's time model.
"""

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deadpool_ext.control.ports import free_port
from deadpool_ext.events import read_events
from tools.bench.common import (
    checkpoint_restart_command,
    MetricsWatch,
    demo_workload,
    iteration_seconds,
    launcher,
    one_shrink,
    print_shrink,
    run,
    worker_pids,
)
from tools.recovery_timeline import recoveries, stage_seconds

NODE_RANKS = (4, 5, 6, 7)  # node 1 of two 4-rank nodes


def hot_swap(opts, workdir: str, fault: bool, nnodes: int = 2, rebuild: str = "all") -> dict:
    events = os.path.join(workdir, "events.jsonl")
    args = demo_workload(opts.iters, workdir, opts.moe)
    args += ["--deadpool", "--deadpool-events", events, "--deadpool-rebuild-groups", rebuild]
    if fault:
        args.append(f"--deadpool-inject=kill:node=1:iter={opts.fail_at}")
    watch = MetricsWatch(os.path.join(workdir, "metrics.jsonl"))
    total = run(launcher(args, spare_nodes=1, nnodes=nnodes), watch)
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


# ----- --scale: the rebuild as the job grows -----
REBUILT = ("ms", "arrive_ms", "groups_ms", "attach_ms")
COUNTED = ("groups_created", "groups_held", "groups_kept", "connections")
REBUILDS = ("all", "changed")  # --deadpool-rebuild-groups: full and partial rebuild


def rebuild_at_scale(opts, workdir: str, ranks: int, rebuild: str) -> dict:
    """One hot swap at ``ranks`` ranks: the timeline, and the rebuild as
    every rank of the new generation saw it (medians, and the slowest)."""
    result = hot_swap(opts, workdir, fault=True, nnodes=ranks // 4, rebuild=rebuild)
    events = read_events(os.path.join(workdir, "events.jsonl"))
    gen = recoveries(events)[0]["gen"]
    rebuilt = [e for e in events if e["event"] == "groups_rebuilt" and e["gen"] == gen]
    survivors = [e for e in rebuilt if e["rank"] not in NODE_RANKS]
    result.update(
        ranks=ranks,
        rebuild=rebuild,
        iteration_s=iteration_seconds(workdir, 2, opts.fail_at - 1),
        rebuilt_ranks=len(rebuilt),
        median={k: statistics.median(e[k] for e in rebuilt) for k in REBUILT + COUNTED},
        slowest={k: max(e[k] for e in rebuilt) for k in REBUILT},
        survivors_arrive_ms=statistics.median(e["arrive_ms"] for e in survivors),
    )
    return result


# The groups' floor: what one group costs a rank, on ``ranks`` gloo processes
# with nothing else running. Groups of 2, ranks / 2 and all ranks (the
# first ranks): their members' cost per member, and everyone else's cost of
# a call for a group they are not in.
FLOOR_GROUPS = 8


def _groups_worker(rank: int, ranks: int, init: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    made, seconds = [], {}
    for size in sorted({2, ranks // 2, ranks}):
        dist.barrier()
        start = time.perf_counter()
        made += [dist.new_group(list(range(size)), backend="gloo") for _ in range(FLOOR_GROUPS)]
        seconds[size] = (time.perf_counter() - start) / FLOOR_GROUPS
    out.put((rank, seconds))
    dist.barrier()
    del made
    dist.destroy_process_group()


def group_floor(ranks: int) -> dict:
    """Per-rank costs of one group, in seconds: ``per_call`` (a group the
    rank is not in: the ranks outside the pairs), ``member`` (size -> a
    member's cost of a group of that size, median over members) and
    ``per_member`` (least squares through zero of those on the size)."""
    queue = mp.get_context("spawn").SimpleQueue()
    # A TCP store, as in a job (the coordinator's): rendezvous cost included.
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_groups_worker, args=(ranks, init, queue), nprocs=ranks)
    seen = dict(queue.get() for _ in range(ranks))
    sizes = sorted(seen[0])
    member = {n: statistics.median(seen[r][n] for r in range(n)) for n in sizes}
    return {
        "ranks": ranks,
        "per_call": statistics.median(seen[r][2] for r in range(2, ranks)),
        "member": member,
        "per_member": sum(n * member[n] for n in sizes) / sum(n * n for n in sizes),
    }


def print_scale(rows: list) -> None:
    print(
        "\n| ranks | groups made again | groups created per rank | held | kept | connections "
        "| megatron's + mirror's groups, median (slowest) | re-point objects | survivors' "
        "arrival | rebuild stage (timeline) | fault to first iteration | iteration |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, s, stages = r["median"], r["slowest"], dict(r["breakdown_ms"])
        print(
            f"| {r['ranks']} | {r['rebuild']} | {m['groups_created']:.0f} | "
            f"{m['groups_held']:g} | {m['groups_kept']:g} | "
            f"{m['connections']:.0f} | {m['groups_ms']:.0f} ms ({s['groups_ms']:.0f}) | "
            f"{m['attach_ms']:.0f} ms | {r['survivors_arrive_ms']:.0f} ms | "
            f"{stages['rebuild groups']} ms | {r['to_first_iteration_s']:.2f} s | "
            f"{r['iteration_s']:.2f} s |"
        )


def print_floor(floors: list) -> None:
    print("\n| ranks | a group the rank is not in | a member, per group size | per member (fit) |")
    print("|---|---|---|---|")
    for f in floors:
        sizes = ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in f["member"].items())
        print(
            f"| {f['ranks']} | {f['per_call'] * 1e3:.3f} ms | {sizes} | "
            f"{f['per_member'] * 1e3:.2f} ms |"
        )


def scale(opts) -> int:
    bad = [n for n in opts.scale if n % 4 or n < 8 or 8 % (n // 4)]
    if bad:
        raise SystemExit(
            f"--scale {bad}: each size must be 4 x a data-parallel size that divides the "
            "demo's 8 micro-batches (8, 16 or 32)"
        )
    rows, floors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in opts.scale:
            for rebuild in REBUILDS:  # side by side, in one run
                workdir = os.path.join(tmp, f"{ranks}-{rebuild}")
                os.makedirs(workdir)
                rows.append(rebuild_at_scale(opts, workdir, ranks, rebuild))
                print(ranks, json.dumps(rows[-1]), flush=True)
            floors.append(group_floor(ranks))
            print(ranks, json.dumps(floors[-1]), flush=True)
    print_scale(rows)
    print_floor(floors)
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump({"options": vars(opts), "scale": rows, "floor": floors}, f, indent=1)
    return 0


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
    p.add_argument(
        "--scale",
        nargs="+",
        type=int,
        metavar="RANKS",
        help="Only the hot swap, at each of these world sizes (8 16 32).",
    )
    opts = p.parse_args(argv)
    if opts.scale:
        return scale(opts)
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
