"""Saving (megatron/training/saving.py) without a process group: a background
write keeps the state its save began with, and a non-persistent save keeps
only the latest before it."""

import os

from megatron.training import checkpointing as ckpt
from megatron.training import saving
from tests.unit_tests.training.test_checkpointing import tracked


def test_a_background_write_keeps_the_state_its_save_began_with():
    """megatron-core's staging leaves host tensors as they are (training
    would change them under a background write); saving copies them."""
    import torch
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    shard = torch.zeros(4)
    buckets = [("__0_0.distcp", "key", ([], [("item", shard)]))]
    staged = FileSystemWriterAsync.preload_tensors(buckets, non_blocking=False)
    copied = saving.host_copies(staged)
    shard.add_(1)  # the next optimizer step
    assert copied[0][2][1][0][1].sum() == 0
    assert staged[0][2][1][0][1].sum() == 4  # the staging alone would write this


def test_a_non_persistent_save_keeps_only_the_latest_before_it(tmp_path):
    for iteration in (2, 3):
        tracked(tmp_path, iteration)
    (tmp_path / "iter_0000004.partial").mkdir()  # a save cut off
    saving.remove_all_but_the_latest(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", ckpt.TRACKER]
