"""Planned operations on the demo workload (TP2 PP2 DP2 on two emulated
4-rank nodes), each in one run through deadpool-launch:

  (a) failure-free, the reference curve;
  (b) drain: node 1 drained at the start of iteration --at (the request
      deadpool-ctl drain sends, made by a planned event), one spare node:
      the job's pause (from the drain's announcement to the first iteration
      completed after it), the coordinator's stages (until every rank
      reported at the boundary, then until all resumed) and each rank's
      (tear-down, rebuild, restore: the slowest rank's), the iterations
      redone, and whether the curve equals (a)'s bit for bit;
  (c) drain with no spare: the job shrinks (DP 2 -> 1): the same figures,
      and the largest relative difference of the curve from (a)'s;
  (d) straggler: node 1 computes --factor times as long from iteration
      --slow-at, --deadpool-on-straggler swap: when the watch found it and
      when its node was swapped, and the median iteration time before the
      slowdown, while slowed and after the swap, side by side in the run.

    python -m tools.bench.operations [--iters 40] [--at 20] [--slow-at 10] [--factor 3]
"""

import argparse
import json
import os
import tempfile

from tools.compare import curve_difference, read_metrics, shrink_difference
from tools.bench.common import deadpool_run, demo_workload, iteration_seconds


def deadpool_job(opts, workdir: str, spares: int, faults, extra=()) -> dict:
    args = demo_workload(opts.iters, workdir) + list(extra)
    out = deadpool_run(args, workdir, faults, spare_nodes=spares)
    metrics = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    return {"total_s": round(out["total_s"], 1), "events": out["events"], "metrics": metrics}


def slowest(events, kind: str) -> float:
    """The slowest rank's time of a stage (each run has one planned generation)."""
    return max(e["ms"] for e in events if e["event"] == kind)


def pause(events) -> dict:
    """The planned generation: from its announcement to the first iteration
    every rank completed after it, and its stages."""
    planned = next(e for e in events if e["event"] == "planned")
    decision = next(e for e in events if e["event"] == "decision")
    recovered = next(e for e in events if e["event"] == "recovered")
    first = max(
        e["time"]
        for e in events
        if e["event"] == "first_iteration_after_recovery" and e["gen"] == decision["gen"]
    )
    stopped = {e["iteration"] for e in events if e["event"] == "failure_seen"}
    ranks = "shrunk" if decision["action"] == "shrink" else None
    stages = {
        "until_decided_s": round(decision["time"] - planned["time"], 3),
        "until_resumed_s": round(recovered["time"] - decision["time"], 3),
        "teardown_ms": slowest(events, "groups_torn_down"),
    }
    if ranks is None:
        stages["rebuild_ms"] = slowest(events, "groups_rebuilt")
        stages["restore_ms"] = slowest(events, "state_restored")
    else:
        stages["resize_ms"] = slowest(events, "shrunk")
    return {
        "action": decision["action"],
        "boundary": sorted(stopped),
        "rollback_to": decision["rollback_to"],
        "iterations_redone": max(stopped) - decision["rollback_to"],
        "pause_s": round(first - planned["time"], 3),
        "coordinator_s": recovered["seconds"],
        "stages": stages,
    }


def largest_difference(got, want) -> float:
    return max(
        abs(g[k] - w[k]) / abs(w[k]) for g, w in zip(got, want) for k in ("lm_loss", "grad_norm")
    )


def stragglers_found(events) -> list:
    """(node, iteration, ratio) of each straggler the watch said."""
    return [(e["node"], e["iteration"], e["ratio"]) for e in events if e["event"] == "straggler"]


def median_seconds(workdir: str, first: int, last: int) -> float:
    return round(iteration_seconds(workdir, first, last), 4)


def straggler(opts, workdir: str, reference: str) -> dict:
    """``reference``: the failure-free run's folder."""
    out = deadpool_job(
        opts,
        workdir,
        1,
        [f"slow:node=1:iter={opts.slow_at}:factor={opts.factor}"],
        ["--deadpool-on-straggler", "swap"],
    )
    events = out["events"]
    found = next(e for e in events if e["event"] == "straggler")
    decision = next(e for e in events if e["event"] == "decision")
    boundary = decision["rollback_to"]
    before = median_seconds(workdir, 3, opts.slow_at - 1)
    slowed = median_seconds(workdir, opts.slow_at + 1, boundary)
    after = median_seconds(workdir, boundary + 2, opts.iters)
    # The failure-free run over the same iterations: the spares' warm-up
    # early in a run takes cores from the ranks on this machine.
    free_before = median_seconds(reference, 3, opts.slow_at - 1)
    free_after = median_seconds(reference, boundary + 2, opts.iters)
    return {
        "found_at_iteration": found["iteration"],
        "ratio_seen": found["ratio"],
        "swapped_after_iteration": boundary,
        "drained": decision["drained"],
        "iteration_s": {"before": before, "slowed": slowed, "after_swap": after},
        "after_over_before": round(after / before, 3),
        "failure_free_s": {"before": free_before, "after": free_after},
        "after_over_failure_free": round(after / free_after, 3),
        "stragglers_found": stragglers_found(events),
        "pause": pause(events),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--at", type=int, default=20, help="The drain's iteration.")
    p.add_argument("--slow-at", type=int, default=10)
    p.add_argument("--factor", type=float, default=3.0)
    p.add_argument("--output", help="Also write the results as JSON here.")
    opts = p.parse_args(argv)
    drain = [f"drain:node=1:iter={opts.at}"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spares, faults in [
            ("failure_free", 1, []),
            ("drain", 1, drain),
            ("drain_shrink", 0, drain),
        ]:
            workdir = os.path.join(tmp, name)
            os.makedirs(workdir)
            out = deadpool_job(opts, workdir, spares, faults)
            results[name] = {"total_s": out["total_s"], "metrics": out["metrics"]}
            results[name]["stragglers_found"] = stragglers_found(out["events"])
            if faults:
                results[name].update(pause(out["events"]))
        reference = results["failure_free"]["metrics"]
        results["drain"]["curve_difference"] = curve_difference(
            results["drain"]["metrics"], reference
        )
        shrunk = results["drain_shrink"]["metrics"]
        results["drain_shrink"]["shrink_difference"] = shrink_difference(shrunk, reference, opts.at)
        results["drain_shrink"]["largest_relative_difference"] = largest_difference(
            shrunk, reference
        )
        workdir = os.path.join(tmp, "straggler")
        os.makedirs(workdir)
        results["straggler"] = straggler(opts, workdir, os.path.join(tmp, "failure_free"))
    for result in results.values():
        result.pop("metrics", None)
    print(json.dumps(results, indent=2))
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
