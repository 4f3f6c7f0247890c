"""The parts of torch_dist checkpointing (megatron/training/checkpointing.py)
that need no process group: publishing a staged save, the saves a retain
interval keeps, each format handed to its reader, and the checks a load
makes before it reads any shard. Saving and loading themselves run in real
processes (test_determinism_and_resume.py, test_hot_swap.py, test_shrink.py)."""

import argparse
import os

import pytest

from megatron.training import checkpoint_files
from megatron.training import checkpointing as ckpt
from megatron.training import checkpointing, legacy_checkpoint, saving
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_files import SaveContents
from tests.unit_tests.training.test_legacy_checkpoint import legacy, pp2_config


def config(*extra):
    argv = [
        "--num-layers",
        "2",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "8",
        "--micro-batch-size",
        "1",
        "--train-iters",
        "4",
        "--lr",
        "1e-3",
        "--mock-data",
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        "100",
        *extra,
    ]
    cfg = parse_args(argv, world_size=1)
    cfg.run.padded_vocab_size = 128
    return cfg


def common(**args):
    shape = dict(num_layers=2, hidden_size=16, num_attention_heads=2, padded_vocab_size=128)
    layout = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    return {
        "checkpoint_version": 3.0,
        "iteration": 4,
        "args": argparse.Namespace(**{**shape, **layout, **args}),
        "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable"},
    }


def loads(cfg) -> bool:
    return ckpt.loads_optimizer(cfg, release=False)


def staged(root, iteration, content):
    staging = root / f"iter_{iteration:07d}{saving.STAGING_SUFFIX}"
    staging.mkdir()
    (staging / "metadata.json").write_text(content)
    return str(staging)


def test_a_staged_save_takes_its_name_and_then_the_tracker_names_it(tmp_path):
    final = checkpoint_files.iteration_dir(str(tmp_path), 8)
    ckpt.publish(str(tmp_path), staged(tmp_path, 8, "first"), final, "8")
    assert (tmp_path / ckpt.TRACKER).read_text() == "8"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000008", ckpt.TRACKER]
    # The same iteration again (a rollback redid it): replaced whole.
    ckpt.publish(str(tmp_path), staged(tmp_path, 8, "second"), final, "8")
    assert (tmp_path / "iter_0000008" / "metadata.json").read_text() == "second"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000008", ckpt.TRACKER]


def test_saves_between_retained_ones_go_when_the_next_is_named(tmp_path):
    """--save-retain-interval 4 with saves every 2: a save stays while it is
    the latest, then only multiples of 4 (and a symbolic link) stay; a save
    of the same iteration again deletes nothing."""
    root = str(tmp_path)

    def save(iteration):
        final = checkpoint_files.iteration_dir(root, iteration)
        ckpt.publish(root, staged(tmp_path, iteration, "x"), final, str(iteration), 4)

    def kept():
        return sorted(int(n[5:]) for n in os.listdir(root) if n.startswith("iter_"))

    for iteration, expected in ((2, [2]), (4, [4]), (6, [4, 6]), (8, [4, 8]), (8, [4, 8])):
        save(iteration)
        assert kept() == expected, iteration
    os.symlink(
        checkpoint_files.iteration_dir(root, 4), checkpoint_files.iteration_dir(root, 10)
    )  # pointed at
    (tmp_path / ckpt.TRACKER).write_text("10")
    save(12)
    assert kept() == [4, 8, 10, 12]
    # Control: without the interval every save stays.
    ckpt.publish(root, staged(tmp_path, 14, "x"), checkpoint_files.iteration_dir(root, 14), "14")
    assert kept() == [4, 8, 10, 12, 14]


def test_a_checkpoint_of_another_model_is_refused_by_name():
    cfg = config()
    ckpt.check_compatible(common(), cfg, "ckpt/iter_0000004", loads(cfg))
    with pytest.raises(checkpoint_files.CheckpointError, match=r"hidden_size 32 \(this run: 16\)"):
        ckpt.check_compatible(common(hidden_size=32), cfg, "ckpt/iter_0000004", loads(cfg))
    old = {**common(), "checkpoint_version": 2.0}
    with pytest.raises(checkpoint_files.CheckpointError, match="checkpoint_version 2.0"):
        ckpt.check_compatible(old, cfg, "ckpt/iter_0000004", loads(cfg))


def test_another_tp_needs_an_optimizer_saved_fully_reshardable():
    saved_at_tp2 = common(tensor_model_parallel_size=2)
    with pytest.raises(
        checkpoint_files.CheckpointError, match="--dist-ckpt-optim-fully-reshardable"
    ):
        ckpt.check_compatible(saved_at_tp2, config(), "d", loads(config()))
    no_optim = config("--no-load-optim")
    ckpt.check_compatible(saved_at_tp2, no_optim, "d", loads(no_optim))
    # A release checkpoint loads no optimizer state either.
    assert not ckpt.loads_optimizer(config(), release=True)
    ckpt.check_compatible(saved_at_tp2, config(), "d", ckpt.loads_optimizer(config(), True))
    fully = {
        **saved_at_tp2,
        "content_metadata": {"distrib_optim_sharding_type": "fully_reshardable"},
    }
    ckpt.check_compatible(fully, config(), "d", loads(config()))


def test_the_writers_results_stay_in_this_process(monkeypatch):
    """No multiprocessing Manager (a process that would outlive a killed
    rank) serves dist_checkpointing's results queue."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    ckpt.keep_write_results_in_process()
    assert type(filesystem_async._get_write_results_queue()) is queue.Queue


def tracked(root, iteration):
    root.mkdir(parents=True, exist_ok=True)
    (root / f"iter_{iteration:07d}").mkdir()
    (root / ckpt.TRACKER).write_text(str(iteration))


def test_a_save_with_a_shard_file_cut_short_missing_or_from_elsewhere_is_named(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    def saved(name, values):
        folder = tmp_path / name
        dcp.save({"a": values, "b": torch.ones(3, 3)}, checkpoint_id=str(folder), no_dist=True)
        (folder / "common.pt").write_bytes(b"")
        return folder

    whole = saved("whole", torch.arange(10.0))
    ckpt.check_whole(str(whole))  # the control
    other = saved("other", torch.arange(20.0))  # another save: other sizes
    (whole / "__0_0.distcp").write_bytes((other / "__0_0.distcp").read_bytes())
    with pytest.raises(
        checkpoint_files.CheckpointError, match=r"__0_0.distcp \(\d+ bytes, the index says"
    ):
        ckpt.check_whole(str(whole))
    (whole / "__0_0.distcp").unlink()
    (whole / "common.pt").unlink()
    with pytest.raises(
        checkpoint_files.CheckpointError, match=r"__0_0.distcp \(missing.*common.pt"
    ):
        ckpt.check_whole(str(whole))


def test_load_checkpoint_hands_each_format_to_its_reader(tmp_path, monkeypatch):
    import types

    seen = []
    contents = SaveContents({"iteration": 4, "args": argparse.Namespace()}, None, None)

    def legacy_reader(directory, config, state, *rest):
        seen.append(("legacy", directory, config, state))
        return contents

    def dist_reader(found, config, state, *rest):
        seen.append(("dist", found.directory, config, state))
        return contents

    monkeypatch.setattr(legacy_checkpoint, "load_legacy", legacy_reader)
    monkeypatch.setattr(checkpointing, "load_torch_dist", dist_reader)
    monkeypatch.setattr(checkpointing, "restore_alike", lambda *a: None)  # after either reader
    cfg, state = pp2_config(), types.SimpleNamespace(model=[None])
    folder = legacy(tmp_path, "mp_rank_00")
    checkpointing.load_checkpoint(checkpoint_files.saved_in(str(tmp_path)), cfg, state)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')  # torch_dist
    checkpointing.load_checkpoint(checkpoint_files.saved_in(str(tmp_path)), cfg, state)
    assert checkpoint_files.saved_in(str(tmp_path / "nothing")) is None
    assert seen == [("legacy", str(folder), cfg, state), ("dist", str(folder), cfg, state)]
