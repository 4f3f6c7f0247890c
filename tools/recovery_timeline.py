"""The recovery timeline of a run, from its --deadpool-events log: for each
recovery, fault -> detected -> decided -> groups rebuilt -> state restored ->
first iteration done; printed as a table and drawn as a PNG next to the
loss curve (from --metrics-file).

    python tools/recovery_timeline.py --events runs/demo/events.jsonl \\
        --metrics runs/demo/metrics.jsonl --output-dir runs/demo
"""

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deadpool_ext.events import read_events  # noqa: E402

STAGES = [("detect", "failure_detected"), ("tear down + report", "decision"),
          ("rebuild groups", "groups_rebuilt"), ("restore state", "state_restored"),
          ("first iteration", "first_iteration_after_recovery")]


def _last(events: List[dict], kind: str, gen: Optional[int] = None) -> Optional[dict]:
    found = [e for e in events if e["event"] == kind and (gen is None or e.get("gen") == gen)]
    return max(found, key=lambda e: e["time"]) if found else None


def recoveries(events: List[dict]) -> List[Dict]:
    """One record per completed recovery, with the time of each stage's end."""
    events = sorted(events, key=lambda e: e["time"])
    out, start = [], 0
    for i, e in enumerate(events):
        if e["event"] != "recovered":
            continue
        span, gen = events[start:i + 1], e["gen"]
        start = i + 1
        detected = [x for x in span if x["event"] == "failure_detected"]
        faults = [x for x in span if x["event"] in ("fault_injected", "failure_seen")]
        first_fault = faults[0] if faults else detected[0]
        # The end of the recovery is the first iteration after it, logged
        # after the "recovered" event; look ahead for it.
        after = [x for x in events[i:] if x["event"] == "first_iteration_after_recovery"
                 and x["gen"] == gen]
        marks = {"fault": first_fault["time"], "failure_detected": detected[0]["time"],
                 "decision": _last(span, "decision", gen)["time"],
                 "groups_rebuilt": _last(span, "groups_rebuilt", gen)["time"],
                 "state_restored": _last(span, "state_restored", gen)["time"],
                 "first_iteration_after_recovery": max(x["time"] for x in after) if after
                 else None}
        decision = _last(span, "decision", gen)
        fault_iteration = next((x["iteration"] for x in faults
                                if x["event"] == "fault_injected"), None)
        out.append({"gen": gen, "marks": marks, "rollback_to": decision["rollback_to"],
                    "replaced": decision["replaced"], "fault_iteration": fault_iteration,
                    "ranks": sorted({r for x in detected for r in x["ranks"]}),
                    "reasons": [x["reason"] for x in detected]})
    return out


def stage_seconds(record: Dict) -> List[tuple]:
    marks, previous, rows = record["marks"], record["marks"]["fault"], []
    for label, key in STAGES:
        if marks[key] is None:
            continue
        rows.append((label, marks[key] - previous))
        previous = marks[key]
    return rows


def total_seconds(record: Dict) -> float:
    end = record["marks"]["first_iteration_after_recovery"] or record["marks"]["state_restored"]
    return end - record["marks"]["fault"]


def print_table(records: List[Dict]) -> None:
    for r in records:
        lost = ("" if r["fault_iteration"] is None
                else f", redoing from iteration {r['rollback_to'] + 1} (fault in "
                f"{r['fault_iteration']})")
        print(f"recovery to generation {r['gen']}: ranks {r['ranks']} lost "
              f"({'; '.join(r['reasons'])}), spares {r['replaced']}{lost}")
        for label, seconds in stage_seconds(r):
            print(f"  {label:<22} {seconds * 1e3:8.0f} ms")
        print(f"  {'fault to first iteration':<22} {total_seconds(r) * 1e3:8.0f} ms")


def draw(records: List[Dict], metrics: List[dict], output_dir: str) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    if metrics:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([m["iteration"] for m in metrics], [m["lm_loss"] for m in metrics], lw=1.2)
        for r in records:
            if r["fault_iteration"] is not None:
                ax.axvline(r["fault_iteration"], color="tab:red", ls="--", lw=1)
        ax.set_xlabel("iteration")
        ax.set_ylabel("lm loss")
        ax.set_title("loss (dashed: a node lost, hot-swapped)")
        paths.append(os.path.join(output_dir, "loss.png"))
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    if records:
        fig, ax = plt.subplots(figsize=(9, 1.4 + 0.5 * len(records)))
        colors = plt.get_cmap("tab10").colors
        for row, r in enumerate(records):
            left = 0.0
            for i, (label, seconds) in enumerate(stage_seconds(r)):
                ax.barh(row, seconds, left=left, color=colors[i],
                        label=label if row == 0 else None)
                left += seconds
        ax.set_yticks(range(len(records)), [f"gen {r['gen']}" for r in records])
        ax.set_xlabel("seconds since the fault")
        ax.set_title("recovery timeline")
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
        paths.append(os.path.join(output_dir, "recovery_timeline.png"))
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", required=True)
    p.add_argument("--metrics")
    p.add_argument("--output-dir", help="Write loss.png and recovery_timeline.png here.")
    opts = p.parse_args(argv)
    records = recoveries(read_events(opts.events))
    if not records:
        print("no recovery in", opts.events)
    print_table(records)
    if opts.output_dir:
        metrics = []
        if opts.metrics and os.path.exists(opts.metrics):
            with open(opts.metrics) as f:
                metrics = [json.loads(line) for line in f]
        for path in draw(records, metrics, opts.output_dir):
            print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
