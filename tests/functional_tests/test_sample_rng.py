"""A resume at another data-parallel size with dropout on (Megatron-LM's
0.1) stays on the uninterrupted run's curve when the draws follow the
sample (--deadpool-sample-rng, on under --deadpool): saved at DP4 after
iteration 4, resumed at DP2, every later iteration within the shrink
tolerance. Negative control: with each rank's own streams
(--no-deadpool-sample-rng) the resumed run leaves it. The shrink and the
grow with dropout are run in test_chaos.py (shrink-as-written,
shrink-then-grow, and the shrink's negative control)."""

import pytest

from tools.compare import SHRINK_TOLERANCE
from dist_utils import TINY_GPT, corpus_run, read_metrics, run_pretrain

pytestmark = pytest.mark.integration

ITERS, SAVED_AT = 8, 4


def train(directory, corpus, ranks, extra=()):
    args = TINY_GPT + [
        "--use-distributed-optimizer",
        "--dist-ckpt-optim-fully-reshardable",
        *corpus_run(directory, corpus, ITERS),
        # Each rank a node of its own: its buddy is on another.
        *("--deadpool", "--deadpool-ranks-per-node", "1"),
        *extra,
    ]
    run_pretrain(ranks, args)
    return read_metrics(directory / "metrics.jsonl")


def resumed_drift(tmp_path, corpus, extra=()) -> float:
    """The largest relative difference in loss or grad norm between a run
    resumed at DP2 from the DP4 run's checkpoint and the DP4 run itself."""
    reference, resumed = tmp_path / "dp4", tmp_path / "dp2"
    ckpt = str(reference / "ckpt")
    want = train(reference, corpus, 4, ["--save", ckpt, "--save-interval", str(SAVED_AT), *extra])
    (reference / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    got = train(resumed, corpus, 2, ["--load", ckpt, *extra])
    assert [m["iteration"] for m in got] == list(range(SAVED_AT + 1, ITERS + 1))
    pairs = [
        (g[key], w[key]) for g, w in zip(got, want[SAVED_AT:]) for key in ("lm_loss", "grad_norm")
    ]
    return max(abs(g - w) / abs(w) for g, w in pairs)


def test_a_resume_at_another_data_parallel_size_keeps_the_curve_with_dropout(
    tmp_path, corpus_prefix
):
    assert resumed_drift(tmp_path, corpus_prefix) <= SHRINK_TOLERANCE


def test_with_each_ranks_own_streams_the_resumed_curve_drifts(tmp_path, corpus_prefix):
    drift = resumed_drift(tmp_path, corpus_prefix, ["--no-deadpool-sample-rng"])
    assert drift > 10 * SHRINK_TOLERANCE, drift
