"""What the draws that follow the sample cost (--deadpool-sample-rng): the
demo's job under torchrun with --deadpool, with and without them, in turn,
and the median iteration of each (steady iterations), with their ratio per
pair of runs.

    python -m tools.bench.sample_rng [--pairs 3] [--iters 30] [--nproc 8]

The reseed runs once per microbatch per model chunk (the demo: 8 per
iteration on each rank); dropout 0.1 and everything else as the demo. Last,
one reseed's time in this process, the hook alone.
"""

import argparse
import statistics
import tempfile

from tools.bench.common import run_once

DEADPOOL = ["--deadpool", "--deadpool-ranks-per-node", "4", "--use-tp-pp-dp-mapping"]
VARIANTS = {"keyed": DEADPOOL, "per-rank": DEADPOOL + ["--no-deadpool-sample-rng"]}


def reseed_us(calls: int = 2000) -> float:
    """One reseed's time in this process (microseconds), on one rank of a
    CPU run: the hook alone, without the job around it."""
    import time
    import types

    from megatron.training import cpu_compat

    cpu_compat.enable(force=True)  # this process is a CPU rank from here on
    from megatron.core.tensor_parallel import random as mcore_random

    from deadpool_ext.rank import sample_rng
    from megatron.training.training import MicrobatchPosition

    for name in ("tensor_model", "expert_model", "expert_tensor"):
        setattr(mcore_random, f"get_{name}_parallel_rank", lambda: 0)
    sample_rng.parallel_state.get_pipeline_model_parallel_rank = lambda: 0
    gpu = types.SimpleNamespace(te_rng_tracker=False, cuda_graph_impl="none")
    config = types.SimpleNamespace(training=types.SimpleNamespace(seed=1234), gpu=gpu)
    hook, trainer = sample_rng.SampleRngHook(config), types.SimpleNamespace()
    start = time.perf_counter()
    for i in range(calls):
        trainer.microbatch = MicrobatchPosition(0, i, 4 * i)
        hook.before_microbatch(trainer)
    return (time.perf_counter() - start) / calls * 1e6


def median_iteration_ms(run: dict, warmup: int) -> float:
    return statistics.median(r["seconds"] for r in run["records"][warmup:]) * 1e3


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="iterations left out")
    parser.add_argument("--nproc", type=int, default=8)
    opts = parser.parse_args(argv)
    rows = []
    for pair in range(opts.pairs):
        ms = {}
        for name, flags in VARIANTS.items():
            with tempfile.TemporaryDirectory() as workdir:
                run = run_once(opts.nproc, opts.iters, flags, workdir)
            ms[name] = median_iteration_ms(run, opts.warmup)
        rows.append((pair + 1, ms["keyed"], ms["per-rank"], ms["keyed"] / ms["per-rank"]))
        print(f"pair {rows[-1][0]}: keyed {rows[-1][1]:.1f} ms, per-rank {rows[-1][2]:.1f} ms")
    print("| pair | keyed (ms) | per-rank (ms) | ratio |")
    print("|---|---|---|---|")
    for pair, keyed, per_rank, ratio in rows:
        print(f"| {pair} | {keyed:.1f} | {per_rank:.1f} | {ratio:.3f} |")
    print(f"median ratio {statistics.median(r[3] for r in rows):.3f}")
    print(f"one reseed in-process: {reseed_us():.1f} us")


if __name__ == "__main__":
    main()
