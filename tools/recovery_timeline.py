"""The recovery timeline of a run, from its --deadpool-events log: for each
recovery, fault -> detected -> decided -> groups rebuilt -> state restored ->
first iteration done; printed as a table and drawn as a PNG next to the
loss curve (from --metrics-file).

Given --reference, the metrics of a failure-free run of the same seed and
flags, it also draws that run's curve under the recovered one and checks the
claim of hot swap: every iteration's loss, grad norm, lr and auxiliary losses
equal the failure-free run's bit for bit (tools/compare.py, as the tests
judge). It exits with 1 when they differ.

    python -m tools.recovery_timeline --events runs/demo/events.jsonl \\
        --metrics runs/demo/metrics.jsonl --reference runs/demo-reference/metrics.jsonl \\
        --output-dir runs/demo
"""

import argparse
import os
import sys
from typing import Dict, List, Optional

from tools.compare import curve_difference, read_metrics
from deadpool_ext.events import read_events

STAGES = [
    ("detect", "failure_detected"),
    ("tear down + report", "decision"),
    ("rebuild groups", "groups_rebuilt"),
    ("restore state", "state_restored"),
    ("first iteration", "first_iteration_after_recovery"),
]
# How an injected fault's action reads after its target: "node 1 killed".
ACTION_PAST = {"kill": "killed", "hang": "hung", "stall": "stalled"}


def _last(events: List[dict], kind: str, gen: Optional[int] = None) -> Optional[dict]:
    found = [e for e in events if e["event"] == kind and (gen is None or e.get("gen") == gen)]
    return max(found, key=lambda e: e["time"]) if found else None


def describe_fault(injected: dict) -> str:
    """'node 1 killed' or 'rank 5 hung', from a fault_injected event (a rank
    fault is injected by its target, which is the event's rank)."""
    target = (
        f"node {injected['node']}"
        if injected.get("node") is not None
        else f"rank {injected['rank']}"
    )
    return f"{target} {ACTION_PAST.get(injected['action'], injected['action'])}"


def recoveries(events: List[dict]) -> List[Dict]:
    """One record per completed recovery, with the time of each stage's end."""
    events = sorted(events, key=lambda e: e["time"])
    out, start = [], 0
    for i, e in enumerate(events):
        if e["event"] != "recovered":
            continue
        span, gen = events[start : i + 1], e["gen"]
        start = i + 1
        detected = [x for x in span if x["event"] == "failure_detected"]
        faults = [x for x in span if x["event"] in ("fault_injected", "failure_seen")]
        first_fault = faults[0] if faults else detected[0]
        # The end of the recovery is the first iteration after it, logged
        # after the "recovered" event; look ahead for it.
        after = [
            x
            for x in events[i:]
            if x["event"] == "first_iteration_after_recovery" and x["gen"] == gen
        ]
        marks = {
            "fault": first_fault["time"],
            "failure_detected": detected[0]["time"],
            "decision": _last(span, "decision", gen)["time"],
            "groups_rebuilt": _last(span, "groups_rebuilt", gen)["time"],
            "state_restored": _last(span, "state_restored", gen)["time"],
            "first_iteration_after_recovery": max(x["time"] for x in after) if after else None,
        }
        decision = _last(span, "decision", gen)
        injected = next((x for x in faults if x["event"] == "fault_injected"), None)
        out.append(
            {
                "gen": gen,
                "marks": marks,
                "rollback_to": decision["rollback_to"],
                "replaced": decision["replaced"],
                "fault_iteration": injected["iteration"] if injected else None,
                "fault": describe_fault(injected) if injected else None,
                "ranks": sorted({r for x in detected for r in x["ranks"]}),
                "reasons": [x["reason"] for x in detected],
            }
        )
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
        lost = (
            ""
            if r["fault_iteration"] is None
            else f", redoing from iteration {r['rollback_to'] + 1} (fault in "
            f"{r['fault_iteration']})"
        )
        print(
            f"recovery to generation {r['gen']}: ranks {r['ranks']} lost "
            f"({'; '.join(r['reasons'])}), spares {r['replaced']}{lost}"
        )
        for label, seconds in stage_seconds(r):
            print(f"  {label:<22} {seconds * 1e3:8.0f} ms")
        print(f"  {'fault to first iteration':<22} {total_seconds(r) * 1e3:8.0f} ms")


# ----- the claim: the recovered curve is the failure-free one -----
# Judged as the tests and the fault campaign judge it (tools/compare.py):
# every iteration's loss, grad norm, lr and auxiliary losses, bit for bit.
def check_against_reference(
    recovered: List[dict], reference: List[dict], reference_path: str
) -> bool:
    """Print whether the recovered curve is the failure-free one; a stale
    reference (the code changed since it ran) fails too, hence the hint."""
    difference = curve_difference(recovered, reference)
    if difference is None:
        print(
            "curve (loss, grad norm, lr, auxiliary losses) equals the failure-free run's "
            f"bit for bit: {len(recovered)} iterations compared"
        )
        return True
    print(
        f"FAILED: the recovered curve differs from the failure-free run of the same "
        f"seed ({difference}). If the code or environment changed since the failure-free "
        f"run, delete {os.path.dirname(reference_path) or '.'} to redo it.",
        file=sys.stderr,
    )
    return False


# ----- pictures -----
def fault_label(records: List[Dict]) -> str:
    faults = [
        f"{r['fault']} at iteration {r['fault_iteration']}"
        for r in records
        if r["fault"] is not None
    ]
    return "with " + ", ".join(faults) if faults else "recovered run"


def draw_loss(
    ax,
    records: List[Dict],
    metrics: List[dict],
    reference: Optional[List[dict]],
    equal: Optional[bool],
) -> None:
    if reference:
        # Wide and pale underneath: where the two agree, the recovered line
        # runs inside it.
        ax.plot(
            [m["iteration"] for m in reference],
            [m["lm_loss"] for m in reference],
            color="0.75",
            lw=5,
            solid_capstyle="round",
            label="failure-free run, same seed",
        )
    ax.plot(
        [m["iteration"] for m in metrics],
        [m["lm_loss"] for m in metrics],
        color="tab:blue",
        lw=1.3,
        label=fault_label(records),
    )
    for r in records:
        if r["fault_iteration"] is not None:
            ax.axvline(r["fault_iteration"], color="tab:red", ls="--", lw=1)
            ax.annotate(
                f"{r['fault']},\n{'spare took over' if r['replaced'] else 'job shrank'}",
                (r["fault_iteration"], 0.97),
                xycoords=("data", "axes fraction"),
                xytext=(4, 0),
                textcoords="offset points",
                va="top",
                fontsize=8,
                color="tab:red",
            )
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    if equal is None:
        ax.set_title("loss (dashed: a node lost, hot-swapped)")
    else:
        compared = len(metrics)
        verdict = f"equal bit for bit over {compared} iterations" if equal else "DIFFERENT"
        ax.set_title(f"loss after a hot swap vs. without a failure: {verdict}")
    ax.legend(loc="upper right", fontsize=8)


def draw_timeline(ax, records: List[Dict], colors) -> None:
    for row, r in enumerate(records):
        left = 0.0
        for i, (label, seconds) in enumerate(stage_seconds(r)):
            ax.barh(row, seconds, left=left, color=colors[i], label=label if row == 0 else None)
            left += seconds
    ax.set_yticks(range(len(records)), [f"gen {r['gen']}" for r in records])
    ax.set_xlabel("seconds since the fault")
    ax.set_title("recovery timeline")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)


def draw(
    records: List[Dict],
    metrics: List[dict],
    output_dir: str,
    reference: Optional[List[dict]] = None,
    equal: Optional[bool] = None,
) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    if metrics:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        draw_loss(ax, records, metrics, reference, equal)
        paths.append(os.path.join(output_dir, "loss.png"))
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    if records:
        fig, ax = plt.subplots(figsize=(9, 1.4 + 0.5 * len(records)))
        draw_timeline(ax, records, plt.get_cmap("tab10").colors)
        paths.append(os.path.join(output_dir, "recovery_timeline.png"))
        fig.tight_layout()
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def read_optional_metrics(path: Optional[str], required: bool) -> List[dict]:
    if path and os.path.exists(path):
        return read_metrics(path)
    if required:
        raise SystemExit(f"no metrics file at {path}")
    return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", required=True)
    p.add_argument("--metrics")
    p.add_argument(
        "--reference",
        help="metrics of a failure-free run of the same seed and "
        "flags: drawn under the recovered curve, which must equal it bit for bit",
    )
    p.add_argument("--output-dir", help="Write loss.png and recovery_timeline.png here.")
    opts = p.parse_args(argv)
    records = recoveries(read_events(opts.events))
    if not records:
        print("no recovery in", opts.events)
    print_table(records)
    metrics = read_optional_metrics(opts.metrics, required=bool(opts.reference))
    reference = read_optional_metrics(opts.reference, required=bool(opts.reference))
    equal = check_against_reference(metrics, reference, opts.reference) if opts.reference else None
    if opts.output_dir:
        for path in draw(records, metrics, opts.output_dir, reference, equal):
            print("wrote", path)
    return 1 if equal is False else 0


if __name__ == "__main__":
    sys.exit(main())
