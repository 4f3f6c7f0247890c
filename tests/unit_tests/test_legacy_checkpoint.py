"""The parts of loading Megatron-LM's legacy ``--ckpt-format torch``
checkpoints that need no process group: telling the format from the
directory, the checks made before any tensor is read, and the flag. Loading
itself runs in real processes (test_megatron_lm_checkpoints.py)."""

import argparse
import os

import pytest
import torch

from megatron.training import checkpoint_files, checkpointing, legacy_checkpoint
from megatron.training.arguments import ConfigError, parse_args
from megatron.training.checkpoint_files import CheckpointError, SaveContents


def config(*extra):
    argv = [
        *("--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2"),
        *("--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "4"),
        *("--lr", "1e-3", "--mock-data", "--pipeline-model-parallel-size", "2"),
        *("--tokenizer-type", "NullTokenizer", "--vocab-size", "100"),
        *extra,
    ]
    return parse_args(argv, world_size=4)


# Two model chunks per pipeline rank (4 layers, PP 2), 2 microbatches per replica.
VIRTUAL_STAGES = ("--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2")
VIRTUAL_STAGES += ("--global-batch-size", "4")


def saved_args(**changes):
    layout = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    return argparse.Namespace(**{**layout, "use_distributed_optimizer": False, **changes})


def legacy(root, *names):
    folder = root / "iter_0000004"
    for name in names:
        (folder / name).mkdir(parents=True)
        torch.save({"args": saved_args()}, folder / name / legacy_checkpoint.MODEL_FILE)
    (root / checkpoint_files.TRACKER).write_text("4")
    return folder


def test_the_format_is_told_from_the_directory(tmp_path):
    folder = legacy(tmp_path / "legacy", "mp_rank_00_000", "mp_rank_00_001")
    assert checkpoint_files.is_legacy(str(folder))
    dist_ckpt = tmp_path / "dist" / "iter_0000004"
    dist_ckpt.mkdir(parents=True)
    (dist_ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert not checkpoint_files.is_legacy(str(dist_ckpt))
    assert not checkpoint_files.is_legacy(str(tmp_path / "nothing"))
    assert not checkpoint_files.is_legacy(str(tmp_path / "dist"))


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
    cfg, state = config(), types.SimpleNamespace(model=[None])
    folder = legacy(tmp_path, "mp_rank_00")
    checkpointing.load_checkpoint(checkpoint_files.saved_in(str(tmp_path)), cfg, state)
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')  # torch_dist
    checkpointing.load_checkpoint(checkpoint_files.saved_in(str(tmp_path)), cfg, state)
    assert checkpoint_files.saved_in(str(tmp_path / "nothing")) is None
    assert seen == [("legacy", str(folder), cfg, state), ("dist", str(folder), cfg, state)]


def test_the_saved_layout_is_read_from_the_first_position(tmp_path):
    folder = legacy(tmp_path, "mp_rank_00_000")
    saved = legacy_checkpoint.saved_state_of_rank_0(str(folder))
    assert saved["args"].pipeline_model_parallel_size == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError) as error:
        legacy_checkpoint.saved_state_of_rank_0(str(empty))
    for name in ("mp_rank_00", "mp_rank_00_000"):
        assert os.path.join(str(empty), name, "model_optim_rng.pt") in str(error.value)


def test_another_tp_or_pp_is_refused_with_what_to_do():
    legacy_checkpoint.check_layout(saved_args(), config(), "d")
    with pytest.raises(CheckpointError) as error:
        legacy_checkpoint.check_layout(
            saved_args(), config("--tensor-model-parallel-size", "2"), "d"
        )
    message = str(error.value)
    assert "saved at TP 1 and PP 2; this run is at TP 2 and PP 2" in message
    assert "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2" in message
    assert "tools/checkpoint" in message and "save it as torch_dist" in message
    with pytest.raises(CheckpointError, match="2 virtual pipeline stage.* this run has 1"):
        legacy_checkpoint.check_layout(
            saved_args(virtual_pipeline_model_parallel_size=2), config(), "d"
        )
    interleaved = config(*VIRTUAL_STAGES)
    legacy_checkpoint.check_layout(
        saved_args(virtual_pipeline_model_parallel_size=2), interleaved, "d"
    )
    with pytest.raises(CheckpointError, match="1 virtual pipeline stage.* this run has 2"):
        legacy_checkpoint.check_layout(saved_args(), interleaved, "d")
    with pytest.raises(CheckpointError, match="expert_model_parallel_size 2"):
        legacy_checkpoint.check_layout(saved_args(expert_model_parallel_size=2), config(), "d")


def test_an_optimizer_of_the_other_kind_is_refused():
    legacy_checkpoint.check_optimizer(saved_args(), config(), "d")
    with pytest.raises(CheckpointError, match="saved without --use-distributed-optimizer"):
        legacy_checkpoint.check_optimizer(saved_args(), config("--use-distributed-optimizer"), "d")


def test_an_unreadable_file_is_named(tmp_path):
    bad = tmp_path / "model_optim_rng.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=f"{bad} cannot be read"):
        legacy_checkpoint.read(str(bad))


def test_ckpt_format_torch_saves_in_the_foreground_without_experts(tmp_path):
    save = ["--save", str(tmp_path / "out"), "--ckpt-format", "torch"]
    assert config(*save).checkpoint.ckpt_format == "torch"
    with pytest.raises(ConfigError, match="--async-save with --ckpt-format torch"):
        config(*save, "--async-save", "--use-persistent-ckpt-worker")
    with pytest.raises(ConfigError, match="--ckpt-format torch_dcp cannot be written or read"):
        config("--ckpt-format", "torch_dcp")


def test_each_model_chunk_loads_from_its_own_key():
    """Megatron-LM saves a pipeline rank's chunks as model0, model1, ...
    (virtual pipeline stages); each chunk takes its own, and a file without
    one is refused by name."""
    import types

    torch.manual_seed(0)
    saved_chunks = [torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)]
    saved = {f"model{i}": chunk.state_dict() for i, chunk in enumerate(saved_chunks)}
    state = types.SimpleNamespace(model=[torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)])
    legacy_checkpoint.load_model(saved, state, checkpointing.model_keys(2), "f.pt")
    for loaded, chunk in zip(state.model, saved_chunks):
        assert torch.equal(loaded.weight, chunk.weight) and torch.equal(loaded.bias, chunk.bias)
    assert not torch.equal(state.model[0].weight, state.model[1].weight)  # not one state twice
    with pytest.raises(CheckpointError, match="f.pt holds no 'model1'"):
        legacy_checkpoint.load_model(
            {"model0": saved["model0"]}, state, checkpointing.model_keys(2), "f.pt"
        )
    one = types.SimpleNamespace(model=[torch.nn.Linear(3, 2)])
    legacy_checkpoint.load_model(
        {"model": saved["model1"]}, one, checkpointing.model_keys(1), "f.pt"
    )
    assert torch.equal(one.model[0].weight, saved_chunks[1].weight)
