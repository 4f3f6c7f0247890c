"""The parts of loading Megatron-LM's legacy ``--ckpt-format torch``
checkpoints (megatron/training/legacy_checkpoint.py) that need no process
group: the saved layout read from the first position, the checks made
before any tensor is read, and each model chunk loaded from its own key.
Loading itself runs in real processes (test_megatron_lm_checkpoints.py)."""

import argparse
import os

import pytest
import torch

from megatron.training import checkpoint_files, checkpointing, legacy_checkpoint
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_files import CheckpointError


def pp2_config(*extra):
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
    legacy_checkpoint.check_layout(saved_args(), pp2_config(), "d")
    with pytest.raises(CheckpointError) as error:
        legacy_checkpoint.check_layout(
            saved_args(), pp2_config("--tensor-model-parallel-size", "2"), "d"
        )
    message = str(error.value)
    assert "saved at TP 1 and PP 2; this run is at TP 2 and PP 2" in message
    assert "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2" in message
    assert "tools/checkpoint" in message and "save it as torch_dist" in message
    with pytest.raises(CheckpointError, match="2 virtual pipeline stage.* this run has 1"):
        legacy_checkpoint.check_layout(
            saved_args(virtual_pipeline_model_parallel_size=2), pp2_config(), "d"
        )
    interleaved = pp2_config(*VIRTUAL_STAGES)
    legacy_checkpoint.check_layout(
        saved_args(virtual_pipeline_model_parallel_size=2), interleaved, "d"
    )
    with pytest.raises(CheckpointError, match="1 virtual pipeline stage.* this run has 2"):
        legacy_checkpoint.check_layout(saved_args(), interleaved, "d")
    with pytest.raises(CheckpointError, match="expert_model_parallel_size 2"):
        legacy_checkpoint.check_layout(saved_args(expert_model_parallel_size=2), pp2_config(), "d")


def test_an_optimizer_of_the_other_kind_is_refused():
    legacy_checkpoint.check_optimizer(saved_args(), pp2_config(), "d")
    with pytest.raises(CheckpointError, match="saved without --use-distributed-optimizer"):
        legacy_checkpoint.check_optimizer(
            saved_args(), pp2_config("--use-distributed-optimizer"), "d"
        )


def test_an_unreadable_file_is_named(tmp_path):
    bad = tmp_path / "model_optim_rng.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=f"{bad} cannot be read"):
        legacy_checkpoint.read(str(bad))


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
