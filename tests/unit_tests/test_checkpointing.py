"""The parts of torch_dist checkpointing that need no process group: the
tracker, publishing a staged save, and the checks a load makes before it
reads any shard. Saving and loading themselves run in real processes
(test_determinism_and_resume.py, test_hot_swap.py, test_shrink.py)."""

import argparse
import os

import pytest

from megatron.training import checkpoint_files
from megatron.training import checkpointing as ckpt
from megatron.training import saving
from megatron.training.arguments import parse_args


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


def test_the_tracker_names_an_iteration_or_release(tmp_path):
    assert checkpoint_files.read_tracker(str(tmp_path)) is None
    (tmp_path / ckpt.TRACKER).write_text("120\n")
    assert checkpoint_files.read_tracker(str(tmp_path)) == "120"
    assert checkpoint_files.checkpoint_dir(str(tmp_path), "120") == str(tmp_path / "iter_0000120")
    (tmp_path / ckpt.TRACKER).write_text("release")
    assert checkpoint_files.checkpoint_dir(str(tmp_path), "release") == str(tmp_path / "release")
    (tmp_path / ckpt.TRACKER).write_text("12a")
    with pytest.raises(
        checkpoint_files.CheckpointError, match="neither an iteration number nor 'release'"
    ):
        checkpoint_files.read_tracker(str(tmp_path))


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


def test_megatron_lm_flag_names_and_defaults():
    c = config().checkpoint
    assert c.ckpt_format == "torch_dist" and c.ckpt_fully_parallel_save is True
    assert c.dist_ckpt_strictness == "assume_ok_unexpected"
    assert config("--no-ckpt-fully-parallel-save").checkpoint.ckpt_fully_parallel_save is False


def test_an_unwritable_save_directory_is_refused_before_anything_starts(tmp_path):
    from megatron.training.arguments import ConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="--save .* cannot be written"):
        config("--save", str(blocker / "ckpt"))
    assert config("--save", str(tmp_path / "new" / "ckpt")).checkpoint.save
    assert not (tmp_path / "new").exists()  # checked, not created


def test_the_writers_results_stay_in_this_process(monkeypatch):
    """No multiprocessing Manager (a process that would outlive a killed
    rank) serves dist_checkpointing's results queue."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    ckpt.keep_write_results_in_process()
    assert type(filesystem_async._get_write_results_queue()) is queue.Queue


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


def megatron_lm_checkpoint(root, legacy, **args):
    """A directory with only what --use-checkpoint-args reads: the tracker
    and the ``args`` (Megatron-LM's names) in common.pt, or in the first
    rank's file of a legacy (--ckpt-format torch) checkpoint."""
    import torch

    folder = root / "iter_0000004"
    name = "mp_rank_00/model_optim_rng.pt" if legacy else "common.pt"
    (folder / name).parent.mkdir(parents=True)
    torch.save({"args": argparse.Namespace(**args), "iteration": 4}, folder / name)
    (root / ckpt.TRACKER).write_text("4")
    return str(root)


@pytest.mark.parametrize("legacy", [False, True], ids=["torch_dist", "torch"])
def test_use_checkpoint_args_takes_the_model_from_the_checkpoint(tmp_path, legacy):
    load = megatron_lm_checkpoint(
        tmp_path,
        legacy,
        num_layers=3,
        hidden_size=48,
        num_attention_heads=4,
        seq_length=32,
        add_bias_linear=False,  # Megatron-LM's dest of --disable-bias-linear
        hidden_dropout=0.0,
        tensor_model_parallel_size=2,
    )
    base = ["--micro-batch-size", "1", "--train-iters", "4", "--lr", "1e-3", "--mock-data"]
    base += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    # Forced flags replace the command line's, the others only fill what it left unset.
    cfg = parse_args(
        base + ["--use-checkpoint-args", "--load", load, "--seq-length", "64"], world_size=1
    )
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (3, 48, 4)
    assert m.seq_length == 64 and m.hidden_dropout == 0.0 and m.disable_bias_linear
    assert cfg.parallel.tensor_model_parallel_size == 1  # only with the mp flag
    with pytest.raises(Exception, match="missing required flags: --num-layers"):
        parse_args(base + ["--load", load], world_size=1)  # the control: not asked
    cfg = parse_args(
        base + ["--use-checkpoint-args", "--use-mp-args-from-checkpoint-args", "--load", load],
        world_size=2,
    )
    assert cfg.parallel.tensor_model_parallel_size == 2


def test_a_pretrained_checkpoint_must_exist(tmp_path):
    with pytest.raises(Exception, match="--pretrained-checkpoint .* holds no checkpoint"):
        config("--pretrained-checkpoint", str(tmp_path))


def test_non_persistent_checkpoints_need_their_type_and_global_is_the_one():
    with pytest.raises(Exception, match="needs --non-persistent-ckpt-type global"):
        config("--save", "s", "--non-persistent-save-interval", "2")
    with pytest.raises(Exception, match="local and in_memory need nvidia-resiliency-ext"):
        config("--save", "s", "--non-persistent-ckpt-type", "local")


def tracked(root, iteration):
    root.mkdir(parents=True, exist_ok=True)
    (root / f"iter_{iteration:07d}").mkdir()
    (root / ckpt.TRACKER).write_text(str(iteration))


def test_load_takes_the_non_persistent_checkpoint_when_it_is_as_new_or_newer(tmp_path):
    load = tmp_path / "ckpt"
    c = config("--load", str(load), "--non-persistent-ckpt-type", "global").checkpoint
    tracked(load, 4)
    assert checkpoint_files.root_to_load(c) == str(load)  # none yet
    tracked(load / checkpoint_files.NON_PERSISTENT, 6)
    assert checkpoint_files.root_to_load(c) == str(load / checkpoint_files.NON_PERSISTENT)
    tracked(load, 8)
    assert checkpoint_files.root_to_load(c) == str(load)
    c.non_persistent_ckpt_type = None  # not asked for: never
    tracked(load / checkpoint_files.NON_PERSISTENT, 9)
    assert checkpoint_files.root_to_load(c) == str(load)


def test_a_non_persistent_save_keeps_only_the_latest_before_it(tmp_path):
    for iteration in (2, 3):
        tracked(tmp_path, iteration)
    (tmp_path / "iter_0000004.partial").mkdir()  # a save cut off
    saving.remove_all_but_the_latest(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", ckpt.TRACKER]


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


def test_exit_on_missing_checkpoint_acts_only_with_a_load_folder(tmp_path):
    """With --load naming an empty folder the run ends before its first
    iteration (exit 0, as Megatron-LM); without --load the flag has no
    effect (the parser says so) and the run starts from scratch."""
    import types

    from megatron.training import cpu_compat

    cpu_compat.import_megatron_core_without_cuda()
    from megatron.training.training import NothingToResume, Trainer

    def trainer(*flags):
        quiet = types.SimpleNamespace(info=lambda *args: None)
        return types.SimpleNamespace(config=config(*flags), state=None, logger=quiet)

    Trainer.load(trainer("--exit-on-missing-checkpoint"))  # starts from scratch
    empty = str(tmp_path / "empty")
    with pytest.raises(NothingToResume, match="--exit-on-missing-checkpoint"):
        Trainer.load(trainer("--exit-on-missing-checkpoint", "--load", empty))
