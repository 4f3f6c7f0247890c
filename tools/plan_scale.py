"""Plan a --deadpool run past this machine: memory per GPU, mirror bytes and
their time on the link, and whether the mirror hides inside one iteration.

    python -m tools.plan_scale --model llama-65b --hardware perlmutter-a100-40 \\
        --tp 4 --pp 8 --dp 16 --global-batch 2048
    python -m tools.plan_scale --model mixtral-8x7b --tp 4 --pp 1 --dp 128 --ep 8 \
        --global-batch 1024
    python -m tools.plan_scale --model llama-65b --mirror-mode grad --mirror-memory device

The arithmetic and its sources are in tools/planning/scale.py.
"""

import argparse

from tools.planning.scale import HARDWARE, MIRROR_MODES, MODELS, Parallel, describe, plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-65b")
    parser.add_argument("--hardware", choices=sorted(HARDWARE), default="perlmutter-a100-40")
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--dp", type=int, default=16)
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE models)")
    parser.add_argument("--etp", type=int, help="expert tensor-parallel size (default --tp)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=2048, help="sequences")
    parser.add_argument("--mfu", type=float, default=0.45)
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="selective")
    parser.add_argument("--mirror-memory", choices=["host", "device"], default="host")
    parser.add_argument(
        "--mirror-mode",
        choices=MIRROR_MODES,
        default=Parallel.mirror_mode,
        help="what travels to the buddy each iteration (--deadpool-mirror-mode)",
    )
    return parser


def main(argv=None) -> None:
    opts = build_parser().parse_args(argv)
    par = Parallel(
        opts.tp,
        opts.pp,
        opts.dp,
        opts.micro_batch,
        opts.global_batch,
        sequence_parallel=opts.tp > 1,
        recompute=opts.recompute,
        ep=opts.ep,
        etp=opts.etp,
        mirror_mode=opts.mirror_mode,
    )
    if opts.mirror_mode == "grad" and opts.mirror_memory == "host":
        raise SystemExit(
            "--mirror-mode grad replays the optimizer step where the replica lies, which "
            "on a GPU must be device memory (as --deadpool-mirror-mode grad): add "
            "--mirror-memory device"
        )
    if MODELS[opts.model].num_experts is None and (opts.ep != 1 or opts.etp is not None):
        raise SystemExit(f"--ep and --etp split experts: {opts.model} has none")
    print(
        describe(
            plan(
                MODELS[opts.model],
                par,
                HARDWARE[opts.hardware],
                opts.mfu,
                opts.mirror_memory == "device",
            )
        )
    )


if __name__ == "__main__":
    main()
