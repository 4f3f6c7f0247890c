"""A seeded campaign of silent data corruption: bit flips against deadpool-launch.

Each run draws a layout (TP/PP/DP on two emulated 4-rank nodes and a spare
node), a mirror mode (grad three times in four), --deadpool-on-sdc
(rollback, or swap one run in four) and one target (param, grad,
optimizer or mirror: one per run, so that a flip nothing can see does not
hide the others), then flips one bit per iteration from iteration 2 on,
each on another rank (another tensor-parallel/pipeline position where two
replicas make the suspects a pair), the element and the bit drawn by the
rank from the flip's seed (``--deadpool-inject flip:...``). Per flip it
counts whether a check caught it (the first ``sdc_detected`` or
``nan_detected`` event after it) and per run whether the job then ended
with the failure-free run's curve and final state, bit for bit.

    python -m tools.sdc_campaign --runs 25 --seed 1 [--workdir runs/sdc]

What each target should give (docs/reliability.md, "Silent data corruption"):
param: caught by the replicas' digests at the next iteration's start and
redone; optimizer: caught by the buddy's replay in grad mode, not in state
mode (the buddy copies what it is sent); mirror: caught in grad mode when
the buddy replays from the flipped replica, overwritten unseen by the next
whole copy in state mode; grad: a flip before the reduction reaches every
replica as an honest gradient (caught only when it makes the gradient
non-finite).
"""

import argparse
import dataclasses
import json
import os
import random
import shutil
import sys
import time
from collections import Counter
from typing import Dict, List

from tools.compare import shrink_difference
from tools import chaos

TARGETS = ["param", "grad", "optimizer", "mirror"]
DETECTIONS = ("sdc_detected", "nan_detected")


@dataclasses.dataclass(frozen=True)
class Run:
    index: int
    seed: int
    layout: chaos.Trial  # the topology, model and mirror mode (its fault fields unused)
    target: str
    on_sdc: str
    flips: tuple  # (rank, iteration, bit) per flip

    def specs(self) -> List[str]:
        return [
            f"flip:rank={r}:iter={i}:target={self.target}:bit={b}:seed={self.seed * 1000 + i}"
            for r, i, b in self.flips
        ]

    def describe(self) -> str:
        t = self.layout
        return (
            f"TP{t.tp}·PP{t.pp}·DP{t.dp} mirror={t.mirror_mode} on-sdc={self.on_sdc} "
            f"{self.target} x{len(self.flips)}"
        )


def victims(rng: random.Random, layout: chaos.Trial, target: str) -> List[int]:
    """Distinct suspects: with two replicas the replicas' digests name both
    of a pair, so each flip goes to another position."""
    world = chaos.NODES * chaos.PER_NODE
    ranks = rng.sample(range(world), world)
    if target != "param" or layout.dp > 2:
        return ranks
    positions = {}
    for rank in ranks:  # --use-tp-pp-dp-mapping: a position's replicas are a block apart
        positions.setdefault(rank % (world // layout.dp), rank)
    return list(positions.values())


def draw(seed: int, index: int) -> Run:
    rng = random.Random(f"sdc:{seed}:{index}")
    tp, pp = rng.choice(chaos.SHAPES)
    mirror = "grad" if rng.random() < 0.75 else "state"
    target = TARGETS[index % len(TARGETS)]
    on_sdc = "swap" if rng.random() < 0.25 else "rollback"
    layout = chaos.Trial(index, seed, tp, pp, 1, "tiny", "rank", 0, 2, "forward", 0)
    layout = dataclasses.replace(layout, mirror_mode=mirror, expect="swap")
    ranks = victims(rng, layout, target)
    width = 32  # the tiny model trains in fp32
    flips = tuple((r, 2 + k, rng.randrange(width)) for k, r in enumerate(ranks))
    iters = 2 + len(flips) + 1
    return Run(index, seed, dataclasses.replace(layout, iters=iters), target, on_sdc, flips)


def attribute(events: List[dict]) -> List[dict]:
    """Each flip with the detection that caught it: the first one after it,
    of its iteration or the next, that names its rank (a NaN any rank
    finds: the reduction spreads a gradient)."""
    ordered = sorted(events, key=lambda e: e["time"])
    detections = [e for e in ordered if e["event"] in DETECTIONS]
    flips, used = [], set()
    for e in ordered:
        if e["event"] != "fault_injected" or e.get("action") != "flip":
            continue
        caught = None
        for i, d in enumerate(detections):
            if i in used or d["time"] < e["time"]:
                continue
            if d["iteration"] not in (e["iteration"], e["iteration"] + 1):
                continue
            if d["event"] == "sdc_detected" and e["rank"] not in d["suspects"]:
                continue
            used.add(i)
            caught = d
            break
        flips.append({"flip": e, "caught": caught})
    return flips


def run(r: Run, workdir: str, limit_s: float) -> dict:
    ref = chaos.reference(r.layout, workdir, limit_s)
    out = os.path.join(workdir, f"sdc-{r.seed}-{r.index:03d}")
    shutil.rmtree(out, ignore_errors=True)
    args = chaos.job_args(r.layout, out) + ["--deadpool-on-sdc", r.on_sdc]
    args += [f"--deadpool-inject={spec}" for spec in r.specs()]
    start = time.monotonic()
    code, tail, timed_out = chaos.launch(args, r.layout.spares, out, limit_s)
    result = judge(r, out, ref, code, timed_out)
    result.update(
        seconds=round(time.monotonic() - start, 1), tail=None if code == 0 else tail[-800:]
    )
    return result


def judge(r: Run, out: str, ref: str, code: int, timed_out: bool) -> dict:
    """What the run's events and end say (again with --recount)."""
    events = chaos.read_jsonl(os.path.join(out, "events.jsonl"))
    flips = attribute(events)
    caught = [f["caught"] for f in flips if f["caught"] is not None]
    shrunk = any(e["event"] == "decision" and e.get("action") == "shrink" for e in events)
    return {
        "index": r.index,
        "draw": r.describe(),
        "target": r.target,
        "mirror": r.layout.mirror_mode,
        "on_sdc": r.on_sdc,
        "code": code,
        "timed_out": timed_out,
        "fired": len(flips),
        "caught": len(caught),
        "checks": dict(Counter(d.get("check", "nan") for d in caught)),
        "swaps": sum(
            1 for e in events if e["event"] == "sdc_detected" and e.get("action") == "swap"
        ),
        "bit_for_bit": code == 0 and not timed_out and chaos.check_swap(out, ref) is None,
        "shrunk": shrunk,
        "within_shrink_tolerance": shrunk and code == 0 and kept_course(out, ref),
    }


def kept_course(out: str, ref: str) -> bool:
    """A run that shrank (swaps beyond the spares) is held to the shrink's
    tolerance: the same samples and lr, loss and grad norm within 1e-5."""
    got = chaos.read_jsonl(os.path.join(out, "metrics.jsonl"))
    want = chaos.read_jsonl(os.path.join(ref, "metrics.jsonl"))
    return shrink_difference(got, want, 1) is None


def recount(path: str, workdir: str) -> List[dict]:
    """Judge the runs of a campaign's --output again from their folders."""
    with open(path) as f:
        saved = json.load(f)
    results = []
    for old in saved["results"]:
        r = draw(saved["seed"], old["index"])
        out = os.path.join(workdir, f"sdc-{r.seed}-{r.index:03d}")
        ref = chaos.reference(r.layout, workdir, 0)
        results.append({**old, **judge(r, out, ref, old["code"], old["timed_out"])})
    return results


def table(results: List[dict]) -> str:
    """Per target and mirror mode: flips fired, caught, and caught in runs
    that ended bit for bit with the failure-free run."""
    rows: Dict[tuple, Counter] = {}
    for r in results:
        c = rows.setdefault((r["target"], r["mirror"]), Counter())
        c["runs"] += 1
        c["fired"] += r["fired"]
        c["caught"] += r["caught"]
        c["redone"] += r["caught"] if r["bit_for_bit"] else 0
        c["runs_bit_for_bit"] += int(r["bit_for_bit"])
        c["swaps"] += r["swaps"]
        c["shrunk"] += int(r["shrunk"])
        c["shrunk_kept"] += int(r["within_shrink_tolerance"])
    lines = [
        "target     mirror  runs  flips  caught  redone bit for bit  runs bit for bit  "
        "swaps  shrunk (within 1e-5)"
    ]
    for (target, mirror), c in sorted(rows.items()):
        lines.append(
            f"{target:<10} {mirror:<6} {c['runs']:>5} {c['fired']:>6} {c['caught']:>7} "
            f"{c['redone']:>19} {c['runs_bit_for_bit']:>17} {c['swaps']:>6}  "
            f"{c['shrunk']} ({c['shrunk_kept']})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", type=int, nargs="*", help="replay these run indices")
    parser.add_argument("--workdir", default=os.path.join(chaos.REPO, "runs", "sdc"))
    parser.add_argument("--limit", type=float, default=400, help="seconds a job may take")
    parser.add_argument("--output", help="write every run's result here (JSON)")
    parser.add_argument("--recount", help="judge the runs of this --output again, run nothing")
    args = parser.parse_args(argv)
    if args.recount:
        print(table(recount(args.recount, args.workdir)))
        return 0
    indices = args.only if args.only else range(args.first, args.first + args.runs)
    os.makedirs(args.workdir, exist_ok=True)
    results = []
    for index in indices:
        r = draw(args.seed, index)
        result = run(r, args.workdir, args.limit)
        results.append(result)
        print(
            f"{index:>4} {r.describe():<52} fired {result['fired']} caught {result['caught']} "
            f"{'bit for bit' if result['bit_for_bit'] else 'DIFFERS'} exit {result['code']} "
            f"{result['seconds']:.0f} s",
            flush=True,
        )
    print(table(results))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"seed": args.seed, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
