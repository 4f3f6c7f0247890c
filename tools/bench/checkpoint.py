"""What a torch_dist checkpoint costs: bytes per save against one copy of
the model and optimizer state, save and load times, and how long an
--async-save holds training, at several layouts of the same 8 ranks and on
the large mirror configuration.

    python -m tools.bench.checkpoint [--output FILE]

Workloads: the `make demo` model and flags (distributed optimizer) at three
layouts of 8 ranks, and tools.bench.mirror's large configuration (2 ranks, DP2,
19M parameters); 2 iterations with a save after each, the same with
--async-save, then a run that loads the last save.
Per layout it reports the bytes of the saved iteration's directory, the
bytes of one copy of its state (every tensor once: the model's weights and
the optimizer's fp32 parameters and Adam moments, read back whole), their
ratio, and what the per-rank format this replaced wrote (every data-parallel
rank saved its stage's whole model: DP copies of the weights, computed from
the same tensors). Save and load times are each rank's own (log lines), the
slowest rank's reported; the second save is the steady one (the first one
starts dist_checkpointing's writer machinery). An async save's blocking
time is what its rank logs as "training was held" (planning the save,
common.pt, and the copy of the shards it writes from).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List

from megatron.training.checkpointing import read_args, read_whole
from tools.bench.common import ENV, REPO, demo_args, strip_outputs, torchrun_command
from tools.bench.mirror import LARGE


def demo_at(tp: str, pp: str) -> List[str]:
    return with_layout(strip_outputs(demo_args()), tp, pp)


# name: (ranks, flags)
CASES = {
    "demo TP2 PP2 DP2": (8, lambda: demo_at("2", "2")),
    "demo TP1 PP2 DP4": (8, lambda: demo_at("1", "2")),
    "demo TP1 PP1 DP8": (8, lambda: demo_at("1", "1")),
    "large DP2": (2, lambda: list(LARGE)),
}
SAVED = re.compile(r"saved checkpoint \S+iter_(\d+) in ([\d.]+) s")
LOADED = re.compile(r"resumed from \S+ at iteration \d+ \(loaded in ([\d.]+) s\)")
HELD = re.compile(
    r"checkpoint of iteration (\d+) is being written in the background "
    r"\(training was held ([\d.]+) s\)"
)


def with_layout(args: List[str], tp: str, pp: str) -> List[str]:
    out = list(args)
    out[out.index("--tensor-model-parallel-size") + 1] = tp
    out[out.index("--pipeline-model-parallel-size") + 1] = pp
    return out


def pretrain(ranks: int, args: List[str], workdir: str) -> str:
    """One torchrun of pretrain_gpt.py; its whole output."""
    metrics = ["--eval-iters", "0", "--metrics-file", os.path.join(workdir, "metrics.jsonl")]
    command = torchrun_command(ranks, args + metrics)
    proc = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def per_iteration(pattern: re.Pattern, output: str) -> Dict[int, float]:
    """The slowest rank's seconds per iteration."""
    seconds: Dict[int, float] = {}
    for iteration, value in pattern.findall(output):
        seconds[int(iteration)] = max(seconds.get(int(iteration), 0.0), float(value))
    return seconds


def directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def state_bytes(state: Dict[str, object]) -> Dict[str, int]:
    """One copy of every tensor, split into model and optimizer."""
    model = optimizer = 0
    for key, value in state.items():
        if hasattr(value, "element_size"):
            n = value.numel() * value.element_size()
            if key.startswith("optimizer."):
                optimizer += n
            else:
                model += n
    return {"model": model, "optimizer": optimizer}


def one_case(name: str, ranks: int, flags: List[str], workdir: str) -> dict:
    ckpt, async_ckpt = os.path.join(workdir, "ckpt"), os.path.join(workdir, "async")
    # Two iterations of a 60-iteration schedule.
    base = flags + ["--train-iters", "2", "--lr-decay-iters", "60"]
    every = ["--save-interval", "1", "--save"]
    saves = per_iteration(SAVED, pretrain(ranks, base + every + [ckpt], workdir))
    background = pretrain(
        ranks, base + every + [async_ckpt, "--async-save", "--use-persistent-ckpt-worker"], workdir
    )
    held, async_saves = per_iteration(HELD, background), per_iteration(SAVED, background)
    loaded = pretrain(ranks, base + ["--load", ckpt], workdir)
    copy = state_bytes(read_whole(ckpt))
    dp = read_args(ckpt).data_parallel_size
    on_disk = directory_bytes(os.path.join(ckpt, "iter_0000002"))
    return {
        "case": name,
        "bytes_on_disk": on_disk,
        "async_bytes_on_disk": directory_bytes(os.path.join(async_ckpt, "iter_0000002")),
        "one_copy_bytes": copy["model"] + copy["optimizer"],
        "ratio_to_one_copy": on_disk / (copy["model"] + copy["optimizer"]),
        "per_rank_format_bytes": dp * copy["model"] + copy["optimizer"],
        "first_save_s": saves[1],
        "save_s": saves[2],
        "async_held_s": held[2],
        "async_save_s": async_saves[2],
        "load_s": max(float(s) for s in LOADED.findall(loaded)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", help="Also write the results as JSON here.")
    opts = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (ranks, flags) in CASES.items():
            workdir = os.path.join(tmp, name.replace(" ", "_"))
            os.makedirs(workdir)
            results.append(one_case(name, ranks, flags(), workdir))
            r = results[-1]
            print(
                f"{name}: {r['bytes_on_disk'] / 2**20:.2f} MiB on disk, one copy "
                f"{r['one_copy_bytes'] / 2**20:.2f} MiB (x{r['ratio_to_one_copy']:.3f}); "
                f"the per-rank format: {r['per_rank_format_bytes'] / 2**20:.2f} MiB; "
                f"save {r['save_s']:.2f} s (first {r['first_save_s']:.2f} s), "
                f"async save holds training {r['async_held_s']:.2f} s "
                f"(written in {r['async_save_s']:.2f} s), load {r['load_s']:.2f} s",
                flush=True,
            )
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
