"""Seeded 8-rank runs (TP2 PP2 DP2, distributed optimizer, dropout on) are
bit-identical, and a run stopped at iteration k and resumed from its
checkpoint continues the same curve to the last bit."""

import pytest

from dist_utils import TINY_GPT, assert_same_state, saved_args, checkpoint_state, curve
from dist_utils import read_metrics, state_difference
from dist_utils import run_pretrain

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
    args = (
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
    return run_pretrain(8, args)


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


def test_resume_continues_the_same_curve(reference, tmp_path, corpus_prefix):
    stop = 3
    train(tmp_path, corpus_prefix, ["--exit-interval", str(stop)])
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
    common = TINY_GPT + [
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--use-distributed-optimizer",
        "--global-batch-size",
        "8",
        "--data-path",
        corpus_prefix,
        "--train-iters",
        str(ITERS),
    ]
    run_pretrain(4, common + ["--load", str(reference / "ckpt"), "--save", str(tmp_path / "dp1")])
    assert saved_args(str(tmp_path / "dp1")).data_parallel_size == 1
    run_pretrain(8, common + ["--load", str(tmp_path / "dp1"), "--save", str(tmp_path / "dp2")])
    final_ref = checkpoint_state(str(reference / "ckpt"))
    assert_same_state(final_ref, checkpoint_state(str(tmp_path / "dp1")))
    assert_same_state(final_ref, checkpoint_state(str(tmp_path / "dp2")))
