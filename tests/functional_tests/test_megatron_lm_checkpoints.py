"""A Megatron-LM user's checkpoints resume here: megatron_lm_writer.py trains
a GPT at TP1·PP2·DP2 the way Megatron-LM (core_v0.16.1) does, without our
trainer, and writes its state as Megatron-LM writes it, in torch_dist and in
the legacy torch format; pretrain_gpt.py resumes each with the same flags.

Exact: a run that resumes at the saved iteration and saves at once (its
--train-iters is the saved iteration) saves the writer's state bit for bit:
every model tensor, every parameter's main copy and Adam moments, the
optimizer's parameter groups and step, the scheduler, every RNG state, the
iteration and the FLOPs so far. Both sides save that state torch_dist with
the optimizer fully reshardable (the writer's ``reference``), so that it is
compared parameter by parameter, without bucket padding. Only the content
metadata differs: Megatron-LM records a fully reshardable optimizer's
``distrib_optim_fully_reshardable_mem_efficient`` flag, which we do not.
Then training goes on from each checkpoint (at DP1, on 2 ranks), and
--finetune takes the weights alone, into a bf16 run too.

And a run here writes the legacy format as Megatron-LM does: the writer's
files back, entry for entry.

Negative controls: a legacy checkpoint refused at another TP, and missing
files named."""

import math
import os
import shutil

import pytest
import torch

from dist_utils import (
    COMMON,
    assert_same_state,
    captured,
    checkpoint_state,
    forkrun,
    forkrun_command,
    model_tensors,
    read_metrics,
    run_pretrain,
)

pytestmark = pytest.mark.integration

WRITER = os.path.join(COMMON, "megatron_lm_writer.py")
SAVED_AT, GBS = 2, 8
# Megatron-LM's flags, for the writer and pretrain_gpt.py alike. NullTokenizer:
# Megatron-LM has no ByteLevelTokenizer (TINY_GPT's).
MODEL = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32"),
    *("--micro-batch-size", "2", "--global-batch-size", str(GBS)),
    *("--lr", "1e-3", "--lr-warmup-iters", "2", "--min-lr", "1e-4"),
    *("--lr-decay-style", "cosine", "--lr-decay-iters", "10"),
    "--use-distributed-optimizer",
    *("--tokenizer-type", "NullTokenizer", "--vocab-size", "500"),
    *("--transformer-impl", "local", "--mock-data"),
    *("--log-interval", "1", "--eval-iters", "0", "--num-workers", "0"),
]
FLAGS = MODEL + ["--pipeline-model-parallel-size", "2"]  # TP1·PP2·DP2 on 4 ranks
LEGACY_FILES = ("mp_rank_00_000", "mp_rank_00_001")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The writer's three directories: torch_dist, torch (legacy), reference."""
    out = tmp_path_factory.mktemp("megatron_lm")
    # Its ranks forked as torchrun would start them (forkrun.py); the writer
    # calls nothing of our trainer.
    args = ["--out", str(out), "--", *FLAGS, "--train-iters", str(SAVED_AT)]
    proc = captured(forkrun_command(4, args, script=WRITER), timeout=300)
    assert proc.returncode == 0, f"writer failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert sorted(os.listdir(out / "torch" / f"iter_{SAVED_AT:07d}")) == list(LEGACY_FILES)
    for name in LEGACY_FILES:
        folder = out / "torch" / f"iter_{SAVED_AT:07d}" / name
        assert sorted(os.listdir(folder)) == ["distrib_optim.pt", "model_optim_rng.pt"]
    return out


def resume(tmp_path, load, iterations: int, nproc: int = 4):
    """pretrain_gpt.py with the writer's flags, loading ``load``."""
    ckpt = tmp_path / "ckpt"
    run_pretrain(
        nproc,
        FLAGS
        + ["--train-iters", str(iterations), "--load", str(load), "--save", str(ckpt)]
        + ["--dist-ckpt-optim-fully-reshardable"]
        + ["--metrics-file", str(tmp_path / "metrics.jsonl")],
    )
    return ckpt


def without_content_metadata(state: dict) -> dict:
    common = {k: v for k, v in state["common"].items() if k != "content_metadata"}
    return {**state, "common": common}


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_megatron_lm_checkpoint_resumes_with_its_state_bit_for_bit(written, tmp_path, fmt):
    ckpt = resume(tmp_path, written / fmt, SAVED_AT)
    assert read_metrics(tmp_path / "metrics.jsonl") == []  # resumed at SAVED_AT: no step
    got = checkpoint_state(str(ckpt))
    want = checkpoint_state(str(written / "reference"))
    assert got["common"]["iteration"] == SAVED_AT
    assert got["common"]["opt_param_scheduler"]["num_steps"] == SAVED_AT * GBS
    # Not vacuous: the writer's Adam moments and RNG states are there to compare.
    moments = [v for k, v in want.items() if k.startswith("optimizer.state.exp_avg.")]
    assert moments and all(v.abs().sum() > 0 for v in moments)
    assert any(k.startswith("rng_state") for k in want)
    assert_same_state(without_content_metadata(got), without_content_metadata(want))


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_and_training_goes_on_from_it_at_another_dp_too(written, tmp_path, fmt):
    """On 2 ranks (TP1·PP2·DP1): both formats load at any data-parallel size."""
    resume(tmp_path, written / fmt, SAVED_AT + 2, nproc=2)
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["iteration"] for m in metrics] == [SAVED_AT + 1, SAVED_AT + 2]
    assert [m["consumed_samples"] for m in metrics] == [(SAVED_AT + 1) * GBS, (SAVED_AT + 2) * GBS]
    assert all(math.isfinite(m["lm_loss"]) and not m["skipped"] for m in metrics)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_finetune_takes_the_weights_only_even_into_bf16(written, tmp_path, fmt):
    """--finetune from either checkpoint, in bf16 on 2 ranks: iteration 0,
    Adam anew, the writer's weights (rounded to bf16) kept by a step at lr 0,
    which shows that the fp32 main parameters were taken from them."""
    lr0 = ["--lr", "0", "--min-lr", "0", "--bf16", "--finetune"]
    ckpt = tmp_path / "ckpt"
    run_pretrain(
        2,
        FLAGS
        + lr0
        + ["--train-iters", "1", "--load", str(written / fmt), "--save", str(ckpt)]
        + ["--dist-ckpt-optim-fully-reshardable"]
        + ["--metrics-file", str(tmp_path / "metrics.jsonl")],
    )
    assert [m["iteration"] for m in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    got = checkpoint_state(str(ckpt))
    want = model_tensors(checkpoint_state(str(written / "reference")))
    assert {k: v.dtype for k, v in model_tensors(got).items()} == {k: torch.bfloat16 for k in want}
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor.to(torch.bfloat16)), key
    steps = {g["step"] for g in got["common"]["optimizer"]["optimizer"]["param_groups"]}
    assert steps == {1}


def test_a_run_saves_the_legacy_format_as_megatron_lm_writes_it(written, tmp_path):
    """--save with --ckpt-format torch (three of Megatron-LM's own test
    configs save so): the writer's state, loaded and saved at once, gives
    the writer's files back, every entry equal but ``args`` (each side's
    own flags)."""
    legacy = tmp_path / "legacy"
    run_pretrain(
        4,
        FLAGS
        + ["--train-iters", str(SAVED_AT), "--load", str(written / "torch")]
        + ["--save", str(legacy), "--ckpt-format", "torch"],
    )
    iteration = f"iter_{SAVED_AT:07d}"
    assert (legacy / "latest_checkpointed_iteration.txt").read_text() == str(SAVED_AT)
    assert sorted(os.listdir(legacy / iteration)) == list(LEGACY_FILES)
    for name in LEGACY_FILES:
        ours, theirs = legacy / iteration / name, written / "torch" / iteration / name
        assert sorted(os.listdir(ours)) == ["distrib_optim.pt", "model_optim_rng.pt"]
        for file in ("model_optim_rng.pt", "distrib_optim.pt"):
            got = torch.load(ours / file, weights_only=False)
            want = torch.load(theirs / file, weights_only=False)
            if file == "model_optim_rng.pt":
                assert got.pop("args").ckpt_format == "torch" and want.pop("args")
                assert got["model"] and got["optimizer"]["optimizer"]["param_groups"]
            assert_same_state(got, want, f"{name}/{file}")
    # Equal to the writer's files, it loads as they do (the tests above).


def failed_run(nproc: int, args) -> str:
    """A run that must fail; its output."""
    proc = forkrun(nproc, args)
    assert proc.returncode != 0, "the run should have failed"
    return proc.stdout + proc.stderr


def test_a_legacy_checkpoint_at_another_tp_is_refused_with_what_to_do(written):
    tp2 = ["--tensor-model-parallel-size", "2"]  # TP2·PP1·DP1 on 2 ranks
    output = failed_run(2, MODEL + tp2 + ["--train-iters", "4", "--load", str(written / "torch")])
    assert "saved at TP 1 and PP 2; this run is at TP 2 and PP 1" in output
    assert "tools/checkpoint" in output and "save it as torch_dist" in output


def test_missing_files_of_a_legacy_checkpoint_are_named(written, tmp_path):
    copy = tmp_path / "torch"
    shutil.copytree(written / "torch", copy)
    folder = copy / f"iter_{SAVED_AT:07d}"
    gone = [folder / "mp_rank_00_001" / name for name in ("distrib_optim.pt", "model_optim_rng.pt")]
    for path in gone:
        os.remove(path)
    output = failed_run(2, FLAGS + ["--train-iters", "4", "--load", str(copy)])
    assert "missing from a legacy checkpoint" in output
    assert all(str(path) in output for path in gone)
