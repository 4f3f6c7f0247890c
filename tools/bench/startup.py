"""How long a deadpool job takes to start: the demo's job (two emulated
4-rank nodes and a spare node), launch to its first iteration's metrics
line, with workers forked from each node's zygote and with each worker
started from its command (DEADPOOL_FORK_WORKERS=0), runs interleaved so that
drift hits both alike.

    python -m tools.bench.startup [--pairs 3] [--iters 3]

Reports each run and the medians side by side, with their ratio.
"""

import argparse
import os
import statistics
import subprocess
import tempfile
import time

from deadpool_ext.control.zygote import FORK_WORKERS_ENV
from tools.bench.common import ENV, REPO, MetricsWatch, demo_args, launcher, strip_outputs

MODES = {"forked": "1", "started": "0"}


def one_start(mode: str, iters: int, workdir: str) -> float:
    """Seconds from launch to the first iteration's metrics line."""
    metrics = os.path.join(workdir, "metrics.jsonl")
    args = strip_outputs(demo_args()) + ["--train-iters", str(iters), "--metrics-file", metrics]
    args += ["--use-tp-pp-dp-mapping", "--deadpool", "--eval-interval", str(iters + 1)]
    args += ["--lr-warmup-iters", "1"]  # the demo warms up over 10: longer than this run
    watch, env = MetricsWatch(metrics), dict(ENV, **{FORK_WORKERS_ENV: MODES[mode]})
    start = time.time()
    with open(os.path.join(workdir, "output.log"), "w") as out:
        proc = subprocess.Popen(launcher(args, 1), cwd=REPO, env=env, stdout=out, stderr=out)
        while proc.poll() is None:
            watch.poll()
            time.sleep(0.02)
    watch.poll()
    if proc.returncode != 0 or not watch.seen:
        raise SystemExit(f"{mode} run failed ({proc.returncode}): see {workdir}/output.log")
    return watch.seen[0][0] - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3)
    opts = parser.parse_args(argv)
    seconds = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as root:
        for pair in range(opts.pairs):
            for mode in MODES:
                workdir = os.path.join(root, f"{mode}-{pair}")
                os.makedirs(workdir)
                seconds[mode].append(one_start(mode, opts.iters, workdir))
                print(f"pair {pair}: {mode:8s} first iteration after {seconds[mode][-1]:.1f} s")
    median = {mode: statistics.median(s) for mode, s in seconds.items()}
    for mode in MODES:
        print(f"median {mode:8s} {median[mode]:6.1f} s")
    print(f"forked / started: {median['forked'] / median['started']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
