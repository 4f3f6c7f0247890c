"""Goodput of a long training run under failures, per recovery strategy:
checkpoint-restart against hot swap, simulated over many seeds.

    python -m tools.goodput --gpus 512 --days 30 --seeds 32

The model (failure rates, strategies, the simulation) is in
tools/planning/goodput.py.
"""

import argparse

from tools.planning.goodput import (
    DAY,
    HOUR,
    Strategy,
    daly_interval,
    job_mtbf_s,
    mean,
    simulate_seeds,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=512)
    parser.add_argument("--days", type=float, default=30)
    parser.add_argument("--seeds", type=int, default=32)
    parser.add_argument("--checkpoint-cost", type=float, default=30.0)
    parser.add_argument("--restart", type=float, default=300.0)
    parser.add_argument("--swap", type=float, default=40.0)
    parser.add_argument("--iteration", type=float, default=23.7)
    return parser


def main(argv=None) -> None:
    opts = build_parser().parse_args(argv)
    mtbf = job_mtbf_s(opts.gpus)
    rate, horizon = 1 / mtbf, opts.days * DAY
    tau = daly_interval(opts.checkpoint_cost, mtbf)
    strategies = [
        Strategy(
            "checkpoint-restart",
            tau,
            opts.checkpoint_cost,
            opts.restart,
            iteration_s=opts.iteration,
        ),
        Strategy(
            "hot swap",
            tau,
            opts.checkpoint_cost,
            opts.restart,
            hot_swap=True,
            iteration_s=opts.iteration,
            swap_s=opts.swap,
        ),
    ]
    print(f"{opts.gpus} GPUs, MTBF {mtbf / HOUR:.1f} h, checkpoint every {tau / 60:.1f} min")
    for s in strategies:
        runs = simulate_seeds(s, rate, horizon, range(opts.seeds))
        print(f"  {s.name:20s} effective training time ratio {mean([r.ratio for r in runs]):.4f}")


if __name__ == "__main__":
    main()
