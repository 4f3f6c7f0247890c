"""Training throughput and start-up time of the demo configuration on this
machine: tokens per second (median over steady iterations) and the time from
launch to the first completed iteration.

    python tools/bench_training.py [--nproc 8] [--iters 30] [--repeats 2]

Extra arguments after ``--`` are passed to pretrain_gpt.py and override the
demo's (argparse keeps the last value).
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def demo_args() -> list:
    """The demo's flags, read from the Makefile so the two never drift."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "-C", REPO, "print-demo-args"],
                         capture_output=True, text=True, check=True).stdout
    return shlex.split(out)


def strip_outputs(args: list) -> list:
    """Drop the demo's --save/--save-interval/--metrics-file: the bench sets its own."""
    drop, kept, skip = {"--save", "--save-interval", "--metrics-file"}, [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in drop:
            skip = True
        else:
            kept.append(arg)
    return kept


def run_once(nproc: int, iters: int, extra: list, workdir: str, base=None) -> dict:
    """One torchrun of pretrain_gpt.py with ``base`` flags (default: the demo's)."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    base = strip_outputs(demo_args()) if base is None else base
    args = base + ["--train-iters", str(iters), "--eval-iters", "0",
                   "--metrics-file", metrics, *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), os.path.join(REPO, "pretrain_gpt.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.time()
    with open(os.path.join(workdir, "stderr.log"), "w+") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
        first_iteration = None
        for line in proc.stdout:
            if first_iteration is None and re.search(r" iteration +1/", line):
                first_iteration = time.time() - start
        failed = proc.wait() != 0
        stderr.seek(0)
        lines = stderr.readlines()
    if failed:
        tail = "".join([l for l in lines if "error:" in l][:3] + lines[-15:])
        raise SystemExit(f"run failed: {shlex.join(cmd)}\n{tail}\n"
                         "(the demo corpus comes from `make data`; `make bench` runs it first)")
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return {"launch_to_first_iteration_s": first_iteration, "records": records,
            "total_s": time.time() - start, "args": args}


def summarize(run: dict, tokens_per_iteration: int, warmup: int) -> dict:
    steady = [r["seconds"] for r in run["records"][warmup:]]
    median = statistics.median(steady)
    return {"median_iteration_ms": median * 1e3, "tokens_per_s": tokens_per_iteration / median,
            "launch_to_first_iteration_s": run["launch_to_first_iteration_s"],
            "total_s": run["total_s"]}


def option(args: list, name: str) -> int:
    return int(args[len(args) - 1 - args[::-1].index(name) + 1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="flags for pretrain_gpt.py (after --)")
    opts = parser.parse_args(argv)
    results = []
    for _ in range(opts.repeats):
        with tempfile.TemporaryDirectory() as workdir:
            run = run_once(opts.nproc, opts.iters, opts.extra, workdir)
        tokens = option(run["args"], "--global-batch-size") * option(run["args"], "--seq-length")
        results.append(summarize(run, tokens, opts.warmup))
        print(json.dumps(results[-1]), flush=True)
    print("| run | median iteration (ms) | tokens/s | launch to first iteration (s) |")
    print("|---|---|---|---|")
    for i, r in enumerate(results, 1):
        print(f"| {i} | {r['median_iteration_ms']:.0f} | {r['tokens_per_s']:.0f} | "
              f"{r['launch_to_first_iteration_s']:.1f} |")


if __name__ == "__main__":
    main()
