"""A torch_dist checkpoint saved at TP2·PP2·DP2 (optimizer saved fully
reshardable) loads at TP1·PP2·DP4 and at TP2·PP1·DP4, and one saved there
loads back at TP2·PP2·DP2; each run trains on and stays on the
uninterrupted run's curve.

Not bit for bit: another TP or PP splits the same matrix products and
reductions differently, so sums are rounded in another order; the loaded
state itself is exact (the model and optimizer are re-cut, not recomputed).
The RNG states are not loaded at another layout (as in Megatron-LM), so
these runs train without dropout.
The tolerance is that of a shrink (test_shrink.py); a negative control
shows that a load without the optimizer's state leaves it."""

import pytest

from dist_utils import TINY_GPT, corpus_run, read_metrics, run_pretrain, saved_args

pytestmark = pytest.mark.integration

ITERS, SAVED_AT = 8, 4
TOLERANCE = 1e-5  # relative, per iteration, on loss and grad norm
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
TP1_PP2 = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"]
TP2_PP1 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"]


def train(directory, corpus, layout, extra=()):
    args = (
        TINY_GPT
        + layout
        + [
            # The RNG states belong to a layout and are not loaded at another; without
            # dropout the curve does not depend on them.
            "--hidden-dropout",
            "0",
            "--attention-dropout",
            "0",
            "--use-distributed-optimizer",
            "--dist-ckpt-optim-fully-reshardable",
            *corpus_run(directory, corpus, ITERS),
            *extra,
        ]
    )
    run_pretrain(8, args)
    return read_metrics(directory / "metrics.jsonl")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_prefix):
    """The uninterrupted run, saving at SAVED_AT (and at the end)."""
    directory = tmp_path_factory.mktemp("reference")
    ckpt = str(directory / "ckpt")
    metrics = train(
        directory, corpus_prefix, TP2_PP2, ["--save", ckpt, "--save-interval", str(SAVED_AT)]
    )
    (directory / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    return directory, metrics


def relative_drift(got, want) -> float:
    """The largest relative difference in loss or grad norm, iteration by iteration."""
    assert [m["iteration"] for m in got] == [m["iteration"] for m in want]
    pairs = [(g[k], w[k]) for g, w in zip(got, want) for k in ("lm_loss", "grad_norm")]
    return max(abs(g - w) / abs(w) for g, w in pairs)


def resumed(tmp_path, corpus, layout, load, extra=()):
    """Iterations SAVED_AT+1 .. ITERS of a run that loads ``load``."""
    return train(tmp_path, corpus, layout, ["--load", load, *extra])


@pytest.mark.parametrize("layout", [TP1_PP2, TP2_PP1], ids=["tp1-pp2-dp4", "tp2-pp1-dp4"])
def test_a_checkpoint_loads_at_another_tp_and_pp_and_trains_on(
    reference, tmp_path, corpus_prefix, layout
):
    directory, want = reference
    got = resumed(tmp_path, corpus_prefix, layout, str(directory / "ckpt"))
    assert [m["iteration"] for m in got] == list(range(SAVED_AT + 1, ITERS + 1))
    for g, w in zip(got, want[SAVED_AT:]):
        assert g["consumed_samples"] == w["consumed_samples"] and g["lr"] == w["lr"]
    assert relative_drift(got, want[SAVED_AT:]) <= TOLERANCE


def test_and_back_to_the_layout_it_came_from(reference, tmp_path, corpus_prefix):
    """Saved at TP1·PP2·DP4 (from the TP2·PP2 checkpoint), loaded at TP2·PP2·DP2."""
    directory, want = reference
    there = tmp_path / "there"
    there.mkdir()
    train(
        there,
        corpus_prefix,
        TP1_PP2,
        ["--load", str(directory / "ckpt"), "--save", str(there / "ckpt"), "--exit-interval", "6"],
    )
    assert saved_args(str(there / "ckpt")).tensor_model_parallel_size == 1
    back = tmp_path / "back"
    back.mkdir()
    got = resumed(back, corpus_prefix, TP2_PP2, str(there / "ckpt"))
    assert [m["iteration"] for m in got] == [7, 8]
    assert relative_drift(got, want[6:]) <= TOLERANCE


def test_the_tolerance_sees_an_optimizer_that_was_not_loaded(reference, tmp_path, corpus_prefix):
    """Negative control: the same load without the optimizer's state (Adam
    starts again) leaves the uninterrupted curve by far more than the tolerance."""
    directory, want = reference
    got = resumed(tmp_path, corpus_prefix, TP1_PP2, str(directory / "ckpt"), ["--no-load-optim"])
    assert relative_drift(got, want[SAVED_AT:]) > 100 * TOLERANCE
