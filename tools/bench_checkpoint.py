"""What a torch_dist checkpoint costs: bytes per save against one copy of
the model and optimizer state, and save and load times, at several layouts
of the same 8 ranks.

    python -m tools.bench_checkpoint [--output FILE]

Workload: the `make demo` model and flags (distributed optimizer), 2
iterations with a save after each, then a run that loads the last one.
Per layout it reports the bytes of the saved iteration's directory, the
bytes of one copy of its state (every tensor once: the model's weights and
the optimizer's fp32 parameters and Adam moments, read back whole), their
ratio, and what the per-rank format this replaced wrote (every data-parallel
rank saved its stage's whole model: DP copies of the weights, computed from
the same tensors). Save and load times are each rank's own (log lines), the
slowest rank's reported; the second save is the steady one (the first one
starts dist_checkpointing's writer machinery).
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
from tools.bench_common import ENV, REPO, demo_args, strip_outputs, torchrun_command

LAYOUTS = {
    "TP2 PP2 DP2": ("2", "2"),
    "TP1 PP2 DP4": ("1", "2"),
    "TP1 PP1 DP8": ("1", "1"),
}
SAVED = re.compile(r"saved checkpoint \S+iter_(\d+) in ([\d.]+) s")
LOADED = re.compile(r"resumed from \S+ at iteration \d+ \(loaded in ([\d.]+) s\)")


def with_layout(args: List[str], tp: str, pp: str) -> List[str]:
    out = list(args)
    out[out.index("--tensor-model-parallel-size") + 1] = tp
    out[out.index("--pipeline-model-parallel-size") + 1] = pp
    return out


def pretrain(args: List[str], workdir: str) -> str:
    """One 8-rank torchrun of pretrain_gpt.py; its whole output."""
    metrics = ["--eval-iters", "0", "--metrics-file", os.path.join(workdir, "metrics.jsonl")]
    command = torchrun_command(8, args + metrics)
    proc = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


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


def one_layout(name: str, tp: str, pp: str, workdir: str) -> dict:
    ckpt = os.path.join(workdir, "ckpt")
    # Two iterations of the demo's 60-iteration schedule.
    base = with_layout(strip_outputs(demo_args()), tp, pp)
    base += ["--train-iters", "2", "--lr-decay-iters", "60"]
    saved = pretrain(base + ["--save", ckpt, "--save-interval", "1"], workdir)
    loaded = pretrain(base + ["--load", ckpt], workdir)
    saves = {}
    for iteration, seconds in SAVED.findall(saved):
        saves.setdefault(int(iteration), []).append(float(seconds))
    copy = state_bytes(read_whole(ckpt))
    dp = read_args(ckpt).data_parallel_size
    on_disk = directory_bytes(os.path.join(ckpt, "iter_0000002"))
    return {
        "layout": name,
        "bytes_on_disk": on_disk,
        "one_copy_bytes": copy["model"] + copy["optimizer"],
        "ratio_to_one_copy": on_disk / (copy["model"] + copy["optimizer"]),
        "per_rank_format_bytes": dp * copy["model"] + copy["optimizer"],
        "first_save_s": max(saves[1]),
        "save_s": max(saves[2]),
        "load_s": max(float(s) for s in LOADED.findall(loaded)),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", help="Also write the results as JSON here.")
    opts = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (tp, pp) in LAYOUTS.items():
            workdir = os.path.join(tmp, name.replace(" ", "_"))
            os.makedirs(workdir)
            results.append(one_layout(name, tp, pp, workdir))
            r = results[-1]
            print(
                f"{name}: {r['bytes_on_disk'] / 2**20:.2f} MiB on disk, one copy "
                f"{r['one_copy_bytes'] / 2**20:.2f} MiB (x{r['ratio_to_one_copy']:.3f}); "
                f"the per-rank format: {r['per_rank_format_bytes'] / 2**20:.2f} MiB; "
                f"save {r['save_s']:.2f} s (first {r['first_save_s']:.2f} s), "
                f"load {r['load_s']:.2f} s",
                flush=True,
            )
    if opts.output:
        with open(opts.output, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
