"""What the silent-data-corruption check costs per iteration: the replicas'
parameter digests at every iteration's start (--deadpool's default for
--check-weight-hash-across-dp-replicas-interval) against a job that checks
once (an interval past the run), in turn, on the demo (8 ranks) and the
large configuration (2 ranks, 19.4 M parameters), with deadpool's mirror
on in both. The time is the log line's (the whole iteration, hooks
included), its median over the steady iterations, and the ratio per pair.

    python -m tools.bench.sdc [--config demo|large|both] [--pairs 3] [--iters 20]

Last, one digest of the large configuration's parameters (78 MB of fp32)
in this process. The grad mode's replay check costs what the mirror modes'
comparison measures (tools/bench/mirror.py).
"""

import argparse
import statistics
import tempfile
import time

import torch

from tools.bench.mirror import CONFIGS

INTERVAL = "--check-weight-hash-across-dp-replicas-interval"
VARIANTS = {"checked": [], "unchecked": [INTERVAL, "1000000"]}


def digest_ms(numel: int = 19_400_000, repeats: int = 5) -> float:
    from deadpool_ext.state.digest import tensor_digest

    tensor = torch.randn(numel)
    start = time.perf_counter()
    for _ in range(repeats):
        tensor_digest(tensor)
    return (time.perf_counter() - start) / repeats * 1e3


def pair(name: str, iters: int, warmup: int) -> dict:
    from tools.bench.common import run_once

    ranks, base, deadpool = CONFIGS[name]
    ms = {}
    for variant, flags in VARIANTS.items():
        with tempfile.TemporaryDirectory() as workdir:
            run = run_once(
                ranks, iters, ["--log-interval", "1"] + deadpool + flags, workdir, base()
            )
        ms[variant] = statistics.median(run["elapsed_ms"][warmup:])
    return ms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["demo", "large", "both"], default="both")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out")
    opts = parser.parse_args(argv)
    names = ["demo", "large"] if opts.config == "both" else [opts.config]
    print("| config | pair | checked (ms) | unchecked (ms) | ratio |")
    print("|---|---|---|---|---|")
    for name in names:
        ratios = []
        for index in range(opts.pairs):
            ms = pair(name, opts.iters, opts.warmup)
            ratios.append(ms["checked"] / ms["unchecked"])
            print(
                f"| {name} | {index + 1} | {ms['checked']:.1f} | {ms['unchecked']:.1f} | "
                f"{ratios[-1]:.3f} |",
                flush=True,
            )
        print(f"{name}: median ratio {statistics.median(ratios):.3f}")
    print(f"one digest of 19.4 M fp32 parameters in-process: {digest_ms():.1f} ms")


if __name__ == "__main__":
    main()
