"""Training throughput and start-up time of the demo configuration on this
machine: tokens per second (median over steady iterations) and the time from
launch to the first completed iteration.

    python -m tools.bench.training [--nproc 8] [--iters 30] [--repeats 2]

Extra arguments after ``--`` are passed to pretrain_gpt.py and override the
demo's (argparse keeps the last value).
"""

import argparse
import json
import statistics
import tempfile

from tools.bench.common import run_once


def summarize(run: dict, tokens_per_iteration: int, warmup: int) -> dict:
    steady = [r["seconds"] for r in run["records"][warmup:]]
    median = statistics.median(steady)
    return {
        "median_iteration_ms": median * 1e3,
        "tokens_per_s": tokens_per_iteration / median,
        "launch_to_first_iteration_s": run["launch_to_first_iteration_s"],
        "total_s": run["total_s"],
    }


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
        print(
            f"| {i} | {r['median_iteration_ms']:.0f} | {r['tokens_per_s']:.0f} | "
            f"{r['launch_to_first_iteration_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
