"""A checkpoint directory's files (megatron/training/checkpoint_files.py): the
tracker, telling the legacy format from the directory, and which root a
load takes when non-persistent checkpoints are saved too."""

import pytest

from megatron.training import checkpoint_files
from megatron.training import checkpointing as ckpt
from tests.unit_tests.training.test_checkpointing import config, tracked
from tests.unit_tests.training.test_legacy_checkpoint import legacy


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


def test_the_format_is_told_from_the_directory(tmp_path):
    folder = legacy(tmp_path / "legacy", "mp_rank_00_000", "mp_rank_00_001")
    assert checkpoint_files.is_legacy(str(folder))
    dist_ckpt = tmp_path / "dist" / "iter_0000004"
    dist_ckpt.mkdir(parents=True)
    (dist_ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert not checkpoint_files.is_legacy(str(dist_ckpt))
    assert not checkpoint_files.is_legacy(str(tmp_path / "nothing"))
    assert not checkpoint_files.is_legacy(str(tmp_path / "dist"))
