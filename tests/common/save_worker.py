"""Run on forked ranks (forkrun.py) by test_saving.py: three saves of a
small sharded state through saving.py, the second with one local write
failing on one rank at one step; each rank prints its outcomes as a JSON line.

  python save_worker.py DIRECTORY STEP RANK OUTPUT [--async]

Each rank writes its outcomes to OUTPUT/rank{RANK}.json.

STEP is where the write fails (none: nowhere): common (rank 0's common.pt), shards (the
rank's shard files), metadata (rank 0's .metadata, inside megatron-core's
finalize), fsync, config (rank 0's metadata.json) or publish (rank 0).
"""

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megatron.training import cpu_compat  # noqa: E402

cpu_compat.enable()

from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402
from megatron.core.dist_checkpointing.serialization import (  # noqa: E402
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.filesystem_async import (  # noqa: E402
    FileSystemWriterAsync,
)

from deadpool_ext.inject import fill_disk, free_disk  # noqa: E402
from megatron.training import checkpoint_files, checkpointing, saving  # noqa: E402


def state(iteration: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = torch.full((1024,), float(iteration * 10 + rank))
    return {
        "iteration": iteration,
        "weight": ShardedTensor.from_rank_offsets("weight", shard, (0, rank, world)),
    }


def on_a_full_disk(function):
    """``function`` run with this rank's disk full: its writes fail for real."""

    @functools.wraps(function)
    def full(*args, **kwargs):
        fill_disk()
        try:
            return function(*args, **kwargs)
        finally:
            free_disk()

    return full


def fail(*args, **kwargs):
    raise OSError(5, "Input/output error")


def break_step(step: str) -> None:
    """This rank's write at ``step`` fails."""
    if step == "common":
        saving.write_common = on_a_full_disk(saving.write_common)
    elif step == "shards":
        saving.write_buckets = on_a_full_disk(saving.write_buckets)
    elif step == "metadata":
        FileSystemWriterAsync.finish = on_a_full_disk(FileSystemWriterAsync.finish)
    elif step == "fsync":
        saving.fsync_tree = fail
    elif step == "config":
        saving.save_config = on_a_full_disk(saving.save_config)
    elif step == "publish":
        checkpointing.publish = fail
    elif step != "none":
        raise SystemExit(f"unknown step {step}")


def save(root: str, iteration: int, background: bool) -> dict:
    strategy = get_default_save_sharded_strategy("torch_dist")
    begun = saving.start(root, iteration, state(iteration), strategy, background)
    if isinstance(begun, saving.Outcome):
        outcome = begun
    else:
        saving.all_written(begun, blocking=True)
        final = checkpoint_files.iteration_dir(root, iteration)
        outcome = saving.finish(
            begun, lambda staging: checkpointing.publish(root, staging, final, str(iteration))
        )
    return {"iteration": iteration, "errors": outcome.errors, "latest": latest(root)}


def latest(root: str):
    return checkpoint_files.read_tracker(root)


def main() -> None:
    root, step, failing, output = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    background = "--async" in sys.argv
    dist.init_process_group("gloo")
    checkpointing.keep_write_results_in_process()
    outcomes = [save(root, 1, background)]
    saved = (checkpointing.publish, saving.__dict__.copy(), FileSystemWriterAsync.finish)
    if dist.get_rank() == failing:
        break_step(step)
    outcomes.append(save(root, 2, background))
    checkpointing.publish, FileSystemWriterAsync.finish = saved[0], saved[2]
    saving.__dict__.update(saved[1])
    outcomes.append(save(root, 3, background))
    with open(os.path.join(output, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"rank": dist.get_rank(), "outcomes": outcomes}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
