"""What --deadpool costs: iteration time without the mirror and with it in
each mode (--deadpool-mirror-mode state, grad), runs interleaved (without,
state, grad, without, state, grad, ...) so drift hits all alike.

    python -m tools.bench.mirror [--config demo|large|moe|both] [--pairs 2] [--iters 20]

Configurations:
  demo   the `make demo` model on 8 ranks (TP2 PP2 DP2, two emulated nodes).
  large  2 ranks, DP=2, a 19M-parameter GPT: a 116 MB snapshot per rank.

Reports, per configuration: median iteration time of each mode (last rank,
iterations after --warmup, all runs of the mode pooled), each mirror mode's
ratio to the run without, bytes sent per rank per iteration, extra memory
per rank, the mirror's own stage times inside training (from the event
log; in grad mode "verify" is the replay, its seal and the verdict), and the
floor: the same work with no training beside it, on two processes.
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

from tools.bench.common import LARGE_MODEL, MOE_FLAGS, demo_args, run_once, strip_outputs

LARGE = LARGE_MODEL + [
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


MODES = ("without", "state", "grad")
STAGES = ("pack_ms", "seal_ms", "exchange_ms", "verify_ms", "wait_ms")


def mirror_stats(events_path: str) -> dict:
    with open(events_path) as f:
        events = [json.loads(line) for line in f]
    ready = next(e for e in events if e["event"] == "mirror_ready")
    snaps = [e for e in events if e["event"] == "mirror_snapshot" and e["iteration"] > 2]
    stages = {
        k: statistics.median(e[k] for e in snaps if k in e)
        for k in STAGES
        if any(k in e for e in snaps)
    }
    return {
        "snapshot_bytes": ready["snapshot_bytes"],
        "sent_bytes": statistics.median(e["bytes"] for e in snaps),
        "extra_bytes": ready["extra_bytes"],
        **stages,
    }


def bench_config(name: str, pairs: int, iters: int, warmup: int) -> dict:
    ranks, base, mirror_flags = CONFIGS[name]
    times = {mode: [] for mode in MODES}
    stats = {}
    for _ in range(pairs):
        for mode in MODES:
            with tempfile.TemporaryDirectory() as workdir:
                events = os.path.join(workdir, "events.jsonl")
                extra = []
                if mode != "without":
                    extra = mirror_flags + ["--deadpool-mirror-mode", mode]
                    extra += ["--deadpool-events", events]
                run = run_once(ranks, iters, extra, workdir, base=base())
                times[mode] += steady_seconds(run, warmup)
                if mode != "without":
                    stats[mode] = mirror_stats(events)
            print(
                f"  {name} {mode}: median {statistics.median(times[mode]) * 1e3:.1f} ms", flush=True
            )
    medians = {mode: statistics.median(times[mode]) * 1e3 for mode in MODES}
    return {
        "config": name,
        "ranks": ranks,
        "ms": medians,
        "ratio": {m: medians[m] / medians["without"] for m in MODES[1:]},
        "stats": stats,
        "floor": {m: floor(stats["state"]["snapshot_bytes"], m) for m in MODES[1:]},
    }


# ----- the floor: the mirror's work alone, on two processes -----
def _floor_worker(rank: int, nbytes: int, mode: str, init: str, repeats: int, out) -> None:
    from deadpool_ext.state import snapshot as snap

    torch.set_num_threads(1)
    torch.optim.AdamW([torch.zeros(1)])  # imports what a trainer's optimizer already has
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    layout = snap.ShardLayout([], (nbytes - snap.HEADER_BYTES - 4096) // 12, 4096)
    source, grad = torch.randn(3 * layout.numel), torch.randn(layout.numel)
    own, held, replica = (snap.allocate(layout) for _ in range(3))
    outgoing, incoming = own, held
    if mode == "grad":  # the packet: gradients and the header's room
        outgoing, incoming = (torch.zeros(4 * layout.numel + 8192, dtype=torch.uint8) for _ in "io")
    samples = []
    for i in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        floats = own[snap.HEADER_BYTES : snap.HEADER_BYTES + 12 * layout.numel].view(torch.float32)
        floats.copy_(source)
        if mode == "grad":
            outgoing[: 4 * layout.numel].view(torch.float32).copy_(grad)
        t1 = time.perf_counter()
        snap.seal(own, layout, i, rank, bytes(2048))  # a sidecar's typical size
        t2 = time.perf_counter()
        requests = [dist.isend(outgoing, 1 - rank), dist.irecv(incoming, 1 - rank)]
        for request in requests:
            request.wait()
        t3 = time.perf_counter()
        if mode == "grad":
            _replay_floor(layout, held, replica, incoming, i)
        else:
            snap.verify(held, layout, iteration=i, owner=1 - rank)
        t4 = time.perf_counter()
        samples.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0))
    if rank == 0:
        out.put([statistics.median(s[k] for s in samples) * 1e3 for k in range(5)])
    dist.destroy_process_group()


def _replay_floor(layout, source, target, packet, iteration) -> None:
    """What the buddy does with a packet: copy its replica, one Adam step of
    torch's (as on CPU) on it, seal it."""
    from deadpool_ext.state import snapshot as snap

    target.copy_(source)
    param, exp_avg, exp_avg_sq = snap.regions(target, layout)
    param.grad = packet[: 4 * layout.numel].view(torch.float32)
    adam = torch.optim.AdamW([param], lr=1e-4)
    step = torch.tensor(float(iteration))
    adam.state[param] = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    adam.step()
    param.grad = None
    snap.seal(target, layout, iteration + 1, 0, bytes(2048))


def floor(nbytes: int, mode: str, repeats: int = 5) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        queue = mp.get_context("spawn").SimpleQueue()
        args = (nbytes, mode, f"file://{workdir}/store", repeats, queue)
        mp.spawn(_floor_worker, args=args, nprocs=2)
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
    print(f"\n### {result['config']} ({result['ranks']} ranks)")
    print(
        "| mode | median iteration (ms) | ratio to without | sent per rank per iteration (MB) "
        "| extra memory per rank (MB) | floor (ms) |"
    )
    print("|---|---|---|---|---|---|")
    print(f"| without --deadpool | {result['ms']['without']:.1f} | | | | |")
    for mode in MODES[1:]:
        stats, f = result["stats"][mode], result["floor"][mode]
        print(
            f"| {mode} | {result['ms'][mode]:.1f} | {result['ratio'][mode]:.4f} | "
            f"{stats['sent_bytes'] / mb:.1f} | {stats['extra_bytes'] / mb:.1f} | "
            f"{f['total_ms']:.1f} |"
        )
    for mode in MODES[1:]:
        stats, f = result["stats"][mode], result["floor"][mode]
        stages = ", ".join(f"{k[:-3]} {stats[k]:.1f} ms" for k in STAGES if k in stats)
        print(f"\n{mode}: stages inside training (medians): {stages}.")
        print(
            f"{mode}: floor (2 processes, nothing else running): copy {f['copy_ms']:.1f} ms, "
            f"checksum {f['seal_ms']:.1f} ms, exchange {f['exchange_ms']:.1f} ms, "
            f"verify/replay {f['verify_ms']:.1f} ms, total {f['total_ms']:.1f} ms."
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=["demo", "large", "moe", "both"], default="both")
    parser.add_argument(
        "--pairs", type=int, default=2, help="rounds of (without, state, grad) runs"
    )
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
