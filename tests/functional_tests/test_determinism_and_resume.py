"""Seeded 8-rank runs (TP2 PP2 DP2, distributed optimizer, dropout on) are
bit-identical, and a run stopped at iteration k and resumed from its
checkpoint continues the same curve to the last bit."""

import filecmp
import os
import random
import shutil
import signal
import time

import pytest

import forkserver
from dist_utils import TINY_GPT, assert_same_state, saved_args, checkpoint_state, curve
from dist_utils import read_metrics, state_difference
from dist_utils import REPO, forkrun_command, run_pretrain, worker_env
from megatron.training.checkpoint_files import NON_PERSISTENT, tracked_iteration

# Every test here starts real processes.
pytestmark = pytest.mark.integration

ITERS = 8
LAYOUT_8 = [
    "--tensor-model-parallel-size",
    "2",
    "--pipeline-model-parallel-size",
    "2",
    "--use-distributed-optimizer",
    "--global-batch-size",
    "8",
]


def train(directory, corpus, extra=()):
    return run_pretrain(8, train_args(directory, corpus, extra))


def train_args(directory, corpus, extra=()):
    return (
        TINY_GPT
        + LAYOUT_8
        + [
            "--data-path",
            corpus,
            "--train-iters",
            str(ITERS),
            "--save",
            str(directory / "ckpt"),
            "--metrics-file",
            str(directory / "metrics.jsonl"),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_prefix):
    directory = tmp_path_factory.mktemp("reference")
    train(directory, corpus_prefix)
    return directory


def test_two_seeded_runs_are_bit_identical(reference, tmp_path, corpus_prefix):
    train(tmp_path, corpus_prefix)
    a = read_metrics(reference / "metrics.jsonl")
    b = read_metrics(tmp_path / "metrics.jsonl")
    assert len(a) == ITERS
    assert curve(a) == curve(b)
    assert_same_state(
        checkpoint_state(str(reference / "ckpt")), checkpoint_state(str(tmp_path / "ckpt"))
    )


def test_another_seed_gives_another_curve(reference, tmp_path, corpus_prefix):
    """The comparison above can fail: a different seed changes the curve."""
    train(tmp_path, corpus_prefix, ["--seed", "4321"])
    assert curve(read_metrics(tmp_path / "metrics.jsonl")) != curve(
        read_metrics(reference / "metrics.jsonl")
    )


STOP = 3


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, corpus_prefix):
    """The reference's run, stopped by --exit-interval after iteration STOP."""
    directory = tmp_path_factory.mktemp("stopped")
    train(directory, corpus_prefix, ["--exit-interval", str(STOP)])
    return directory


def test_resume_continues_the_same_curve(reference, stopped, tmp_path, corpus_prefix):
    stop = STOP
    shutil.copytree(stopped, tmp_path, dirs_exist_ok=True)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == stop
    train(tmp_path, corpus_prefix, ["--load", str(tmp_path / "ckpt")])
    resumed = read_metrics(tmp_path / "metrics.jsonl")
    assert curve(resumed) == curve(read_metrics(reference / "metrics.jsonl"))
    final = checkpoint_state(str(tmp_path / "ckpt"))
    assert_same_state(checkpoint_state(str(reference / "ckpt")), final)
    # The comparison sees every tensor: the checkpoint of iteration 3 differs.
    stopped = checkpoint_state(str(tmp_path / "ckpt"), iteration=stop)
    assert stopped.keys() == final.keys()
    assert any(k.startswith("optimizer.") for k in final) and "rng_state/shard_0.0_2.2" in final
    assert state_difference(stopped, final) is not None


def test_a_checkpoint_loads_at_another_data_parallel_size(reference, tmp_path, corpus_prefix):
    """The reference's final checkpoint (DP 2) loaded by 4 ranks (DP 1, its
    optimizer shards cut anew for other bucket padding by dist_checkpointing)
    and saved again, then loaded by 8 ranks (DP 2) and saved: both hold the
    reference's state bit for bit. Nothing is trained (the loads are at the
    last iteration), so any element misplaced by the re-sharding shows."""
    common = TINY_GPT + LAYOUT_8 + ["--data-path", corpus_prefix, "--train-iters", str(ITERS)]
    run_pretrain(4, common + ["--load", str(reference / "ckpt"), "--save", str(tmp_path / "dp1")])
    assert saved_args(str(tmp_path / "dp1")).data_parallel_size == 1
    run_pretrain(8, common + ["--load", str(tmp_path / "dp1"), "--save", str(tmp_path / "dp2")])
    final_ref = checkpoint_state(str(reference / "ckpt"))
    assert_same_state(final_ref, checkpoint_state(str(tmp_path / "dp1")))
    assert_same_state(final_ref, checkpoint_state(str(tmp_path / "dp2")))


def test_two_distributed_optimizers_load_and_save_the_same_state(
    reference, tmp_path, corpus_prefix
):
    """--num-distributed-optimizer-instances 2 (one optimizer per replica,
    gradients all-reduced between them): the reference's final checkpoint,
    loaded and saved so, holds its state bit for bit."""
    common = TINY_GPT + LAYOUT_8 + ["--data-path", corpus_prefix, "--train-iters", str(ITERS)]
    two = ["--num-distributed-optimizer-instances", "2"]
    run_pretrain(8, common + two + ["--load", str(reference / "ckpt"), "--save", str(tmp_path)])
    assert saved_args(str(tmp_path)).num_distributed_optimizer_instances == 2
    assert_same_state(checkpoint_state(str(reference / "ckpt")), checkpoint_state(str(tmp_path)))


def shard_files(directory) -> list:
    return sorted(n for n in os.listdir(directory) if n.endswith(".distcp"))


def test_an_async_save_writes_what_a_sync_save_writes(reference, stopped, tmp_path, corpus_prefix):
    """--async-save at iteration STOP is written while training goes on
    (the state changes under it): its shard files equal, byte for byte, the
    synchronous save of the stopped run, and its last those of the reference,
    which was written from the plan of the first save
    (--ckpt-assume-constant-structure)."""
    async_flags = ["--async-save", "--use-persistent-ckpt-worker"]
    constant = ["--ckpt-assume-constant-structure", "--save-interval", str(STOP)]
    train(tmp_path, corpus_prefix, async_flags + constant)
    assert curve(read_metrics(tmp_path / "metrics.jsonl")) == curve(
        read_metrics(reference / "metrics.jsonl")
    )
    for sync, iteration in ((stopped, STOP), (reference, ITERS)):
        ours = tmp_path / "ckpt" / f"iter_{iteration:07d}"
        theirs = sync / "ckpt" / f"iter_{iteration:07d}"
        names = shard_files(theirs)
        assert names and shard_files(ours) == names
        _, differ, _ = filecmp.cmpfiles(ours, theirs, names, shallow=False)
        assert not differ, f"iteration {iteration}: {differ}"
        assert_same_state(
            checkpoint_state(str(tmp_path / "ckpt"), iteration=iteration),
            checkpoint_state(str(sync / "ckpt"), iteration=iteration),
        )


def test_a_save_killed_midway_leaves_the_last_one_loadable(reference, tmp_path, corpus_prefix):
    """The whole job is SIGKILLed at a random moment of a save (one every
    iteration): the tracker names a whole checkpoint, and the run resumed
    from it continues the reference's curve to the last bit."""
    ckpt = tmp_path / "ckpt"
    args = ["--save-interval", "1"]

    def saving_after_2() -> bool:
        partial = [n for n in os.listdir(ckpt) if n.endswith(".partial")] if ckpt.exists() else []
        return bool(partial) and int(partial[0][5:12]) > 2

    assert kill_when(tmp_path, corpus_prefix, args, saving_after_2, random.Random(STOP))
    entry = tracked_iteration(str(ckpt))
    assert entry is not None and entry >= 2
    resume_and_compare(reference, tmp_path, corpus_prefix, args, ckpt, entry)


def test_a_killed_run_resumes_from_its_newer_non_persistent_save(
    reference, tmp_path, corpus_prefix
):
    """--non-persistent-save-interval 1 beside --save-interval 4: killed
    after the non-persistent save of iteration 6, the job resumes from it
    (newer than the persistent 4), bit for bit; only the latest
    non-persistent saves are kept."""
    ckpt = tmp_path / "ckpt"
    quick = ckpt / NON_PERSISTENT
    args = ["--save-interval", "4", "--non-persistent-save-interval", "1"]
    args += ["--non-persistent-ckpt-type", "global"]
    saved_6 = lambda: (tracked_iteration(str(quick)) or 0) >= 6  # noqa: E731
    assert kill_when(tmp_path, corpus_prefix, args, saved_6)
    entry = tracked_iteration(str(quick))
    assert tracked_iteration(str(ckpt)) == 4 and entry >= 6
    assert len([n for n in os.listdir(quick) if n.startswith("iter_")]) <= 2
    resume_and_compare(reference, tmp_path, corpus_prefix, args, ckpt, entry)


def kill_when(tmp_path, corpus, args, ready, delay: random.Random = None) -> bool:
    """Starts the 8-rank run and SIGKILLs all of it once ``ready()`` (after
    a random delay of up to 50 ms); whether it was ready before it ended."""
    with open(os.devnull, "w") as nowhere:
        job = forkserver.start_logged(
            forkrun_command(8, train_args(tmp_path, corpus, args)), worker_env(), REPO, nowhere
        )
    seen, deadline = False, time.monotonic() + 240
    try:
        while job.poll() is None and time.monotonic() < deadline and not seen:
            seen = ready()
            time.sleep(0.002)
        if seen and delay is not None:
            time.sleep(delay.uniform(0, 0.05))
    finally:
        try:  # the fork server reaps a job that ended by itself
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()
    return seen


def resume_and_compare(reference, tmp_path, corpus, args, ckpt, entry: int) -> None:
    """Resumed from ``ckpt`` at ``entry``, the run ends on the reference's curve and state."""
    train(tmp_path, corpus, args + ["--load", str(ckpt)])
    got = read_metrics(tmp_path / "metrics.jsonl")
    want = read_metrics(reference / "metrics.jsonl")
    assert curve(got[-(ITERS - entry) :]) == curve(want)[entry:]
    assert_same_state(checkpoint_state(str(reference / "ckpt")), checkpoint_state(str(ckpt)))


def test_a_pretrained_checkpoint_starts_a_fine_tuning(reference, tmp_path, corpus_prefix):
    """--pretrained-checkpoint while --load holds nothing: the reference's
    last weights, from iteration 0 with a fresh optimizer (as --finetune)."""
    ckpt = str(tmp_path / "ckpt")
    extra = ["--pretrained-checkpoint", str(reference / "ckpt"), "--load", ckpt]
    train(tmp_path, corpus_prefix, extra + ["--train-iters", "3"])
    tuned = read_metrics(tmp_path / "metrics.jsonl")
    scratch = read_metrics(reference / "metrics.jsonl")
    assert [m["iteration"] for m in tuned] == [1, 2, 3]
    # The first batch is the reference's first: the loaded (trained) model does
    # better on it than the reference's fresh one did. (Without the load the two
    # are the same run: equal losses, same seed and data. The loss on the
    # reference's last batch is another batch's, no bound on this one.)
    assert tuned[0]["lm_loss"] < scratch[0]["lm_loss"]
    args = saved_args(ckpt)
    assert args.finetune and args.iteration == 3


def test_an_interleaved_run_resumes_bit_for_bit_from_a_fully_reshardable_save(
    tmp_path, corpus_prefix
):
    """PP2·VP2 with tied embeddings: the first stage's word embedding has a
    gradient bucket of its own, after the layers' padded one. Saved fully
    reshardable at iteration 2 and resumed there, the run ends on the
    uninterrupted run's curve and state (megatron-core 0.16 alone saves
    the embedding's optimizer state from past the layers' padding: the
    resumed loss then leaves the curve at iteration 3, 6.112 for 6.053)."""
    interleaved = TINY_GPT + [
        "--pipeline-model-parallel-size",
        "2",
        "--num-layers-per-virtual-pipeline-stage",
        "1",
        "--use-distributed-optimizer",
        "--dist-ckpt-optim-fully-reshardable",
        "--global-batch-size",
        "8",
        "--data-path",
        corpus_prefix,
        "--train-iters",
        "4",
        "--save-interval",
        "2",
    ]

    def train_4_ranks(directory, extra=()):
        out = [
            "--save",
            str(directory / "ckpt"),
            "--metrics-file",
            str(directory / "metrics.jsonl"),
        ]
        run_pretrain(4, interleaved + out + list(extra))
        return read_metrics(directory / "metrics.jsonl")

    whole = train_4_ranks(tmp_path / "whole")
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "whole" / "ckpt" / "iter_0000002", resumed / "ckpt" / "iter_0000002")
    (resumed / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    got = train_4_ranks(resumed, ["--load", str(resumed / "ckpt")])
    assert [m["iteration"] for m in got] == [3, 4]
    assert curve(got) == curve(whole)[2:]
    final = checkpoint_state(str(tmp_path / "whole" / "ckpt"))
    assert any(k.startswith("optimizer.") for k in final)
    assert_same_state(final, checkpoint_state(str(resumed / "ckpt")))
