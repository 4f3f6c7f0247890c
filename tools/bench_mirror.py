"""What --deadpool costs: iteration time with and without the mirror,
runs interleaved (without, with, without, with, ...) so drift hits both alike.

    python -m tools.bench_mirror [--config demo|large|moe|both] [--pairs 2] [--iters 20]

Configurations:
  demo   the `make demo` model on 8 ranks (TP2 PP2 DP2, two emulated nodes).
  large  2 ranks, DP=2, a 19M-parameter GPT: a 116 MB snapshot per rank.

Reports, per configuration: median iteration time of each mode (last rank,
iterations after --warmup, all runs of the mode pooled), their ratio, bytes
sent per rank per iteration, extra memory per rank, the mirror's own stage
times inside training (from the event log), and the floor: the same copy,
checksum, exchange and verification with no training beside it.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tools.bench_common import MOE_FLAGS, demo_args, run_once, strip_outputs

LARGE = [
    "--num-layers",
    "6",
    "--hidden-size",
    "512",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "512",
    "--max-position-embeddings",
    "512",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--use-distributed-optimizer",
    "--lr",
    "1e-4",
    "--min-lr",
    "1e-5",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "2",
    "--data-path",
    "data/corpus_text_document",
    "--tokenizer-type",
    "ByteLevelTokenizer",
    "--num-workers",
    "0",
    "--eval-iters",
    "0",
    "--log-interval",
    "5",
]
CONFIGS = {
    # name: (ranks, base flags, flags that turn the mirror on)
    "demo": (
        8,
        lambda: strip_outputs(demo_args()) + ["--use-tp-pp-dp-mapping"],
        ["--deadpool", "--deadpool-ranks-per-node", "4"],
    ),
    "large": (2, lambda: list(LARGE), ["--deadpool", "--deadpool-ranks-per-node", "1"]),
    "moe": (
        8,
        lambda: strip_outputs(demo_args()) + ["--use-tp-pp-dp-mapping"] + MOE_FLAGS,
        ["--deadpool", "--deadpool-ranks-per-node", "4"],
    ),
}


def steady_seconds(run: dict, warmup: int) -> list:
    return [r["seconds"] for r in run["records"][warmup:]]


def mirror_stats(events_path: str) -> dict:
    with open(events_path) as f:
        events = [json.loads(line) for line in f]
    ready = next(e for e in events if e["event"] == "mirror_ready")
    snaps = [e for e in events if e["event"] == "mirror_snapshot" and e["iteration"] > 2]
    stages = {
        k: statistics.median(e[k] for e in snaps if k in e)
        for k in ("pack_ms", "seal_ms", "exchange_ms", "verify_ms", "wait_ms")
        if any(k in e for e in snaps)
    }
    return {
        "snapshot_bytes": ready["snapshot_bytes"],
        "extra_bytes": ready["extra_bytes"],
        **stages,
    }


def bench_config(name: str, pairs: int, iters: int, warmup: int) -> dict:
    ranks, base, mirror_flags = CONFIGS[name]
    times = {"without": [], "with": []}
    stats = None
    for _ in range(pairs):
        for mode in ("without", "with"):
            with tempfile.TemporaryDirectory() as workdir:
                events = os.path.join(workdir, "events.jsonl")
                extra = mirror_flags + ["--deadpool-events", events] if mode == "with" else []
                run = run_once(ranks, iters, extra, workdir, base=base())
                times[mode] += steady_seconds(run, warmup)
                if mode == "with":
                    stats = mirror_stats(events)
            print(
                f"  {name} {mode}: median {statistics.median(times[mode]) * 1e3:.1f} ms", flush=True
            )
    without, with_ = (statistics.median(times[m]) for m in ("without", "with"))
    return {
        "config": name,
        "ranks": ranks,
        "without_ms": without * 1e3,
        "with_ms": with_ * 1e3,
        "ratio": with_ / without,
        **stats,
        "floor": floor(stats["snapshot_bytes"]),
    }


# ----- the floor: the mirror's work alone, on two processes -----
def _floor_worker(rank: int, nbytes: int, init: str, repeats: int, out) -> None:
    from deadpool_ext.state import snapshot as snap

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    layout = snap.ShardLayout([], (nbytes - snap.HEADER_BYTES - 4096) // 12, 4096)
    source = torch.randn(3 * layout.numel)
    own, held = snap.allocate(layout), snap.allocate(layout)
    samples = []
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        floats = own[snap.HEADER_BYTES : snap.HEADER_BYTES + 12 * layout.numel].view(torch.float32)
        floats.copy_(source)
        t1 = time.perf_counter()
        snap.seal(own, layout, i, rank, bytes(2048))  # a sidecar's typical size
        t2 = time.perf_counter()
        requests = [dist.isend(own, 1 - rank), dist.irecv(held, 1 - rank)]
        for request in requests:
            request.wait()
        t3 = time.perf_counter()
        snap.verify(held, layout, iteration=i, owner=1 - rank)
        t4 = time.perf_counter()
        samples.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0))
    if rank == 0:
        out.put([statistics.median(s[k] for s in samples) * 1e3 for k in range(5)])
    dist.destroy_process_group()


def floor(nbytes: int, repeats: int = 5) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_floor_worker, args=(nbytes, f"file://{workdir}/store", repeats, queue), nprocs=2)
        copy, seal, exchange, verify, total = queue.get()
    return {
        "copy_ms": copy,
        "seal_ms": seal,
        "exchange_ms": exchange,
        "verify_ms": verify,
        "total_ms": total,
    }


def report(result: dict) -> None:
    mb = 2**20
    f = result["floor"]
    print(f"\n### {result['config']} ({result['ranks']} ranks)")
    print(
        "| without --deadpool (ms) | with (ms) | ratio | snapshot sent per rank per "
        "iteration (MB) | extra memory per rank (MB) |"
    )
    print("|---|---|---|---|---|")
    print(
        f"| {result['without_ms']:.1f} | {result['with_ms']:.1f} | {result['ratio']:.4f} | "
        f"{result['snapshot_bytes'] / mb:.1f} | {result['extra_bytes'] / mb:.1f} |"
    )
    stages = ", ".join(
        f"{k[:-3]} {result[k]:.1f} ms"
        for k in ("pack_ms", "seal_ms", "exchange_ms", "verify_ms", "wait_ms")
        if k in result
    )
    print(f"\nMirror stages inside training (medians): {stages}.")
    print(
        f"Floor (2 processes, nothing else running): copy {f['copy_ms']:.1f} ms, checksum "
        f"{f['seal_ms']:.1f} ms, exchange {f['exchange_ms']:.1f} ms, verify "
        f"{f['verify_ms']:.1f} ms, total {f['total_ms']:.1f} ms."
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["demo", "large", "moe", "both"], default="both")
    parser.add_argument("--pairs", type=int, default=2, help="(without, with) run pairs")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="iterations left out")
    opts = parser.parse_args(argv)
    names = ["demo", "large"] if opts.config == "both" else [opts.config]
    results = [bench_config(n, opts.pairs, opts.iters, opts.warmup) for n in names]
    for result in results:
        report(result)
    print("\n" + json.dumps(results))


if __name__ == "__main__":
    main()
