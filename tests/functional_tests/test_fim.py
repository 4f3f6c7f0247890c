"""Fill-in-the-middle training under a hot swap: a rank killed in a
--fim-data job comes back from its buddy and the job ends on the
failure-free run's curve and state, bit for bit. It holds because a
sample's reordering is keyed by its index (megatron/training/fim.py), not
drawn in reading order as in Megatron-LM, where the recovered rank would
read its samples reordered otherwise."""

import pytest

from dist_utils import (
    assert_same_run,
    gpt2_bpe_data,
    launch_deadpool,
    must_succeed,
)

pytestmark = pytest.mark.integration

ITERS = 6


def test_a_fim_job_recovers_from_a_killed_rank_bit_for_bit(corpus_prefix, tmp_path, monkeypatch):
    corpus, tokenizer_files = gpt2_bpe_data(corpus_prefix)
    monkeypatch.setenv("HOT_SWAP_CORPUS", corpus)  # deadpool_args' --data-path
    flags = [
        *("--num-layers", "2", "--tensor-model-parallel-size", "2", "--use-tp-pp-dp-mapping"),
        *("--tokenizer-type", "GPT2BPETokenizer", *tokenizer_files),  # over TINY_GPT's
        *("--fim-data", "--fim-rate", "0.9"),
    ]
    reference, recovered = tmp_path / "reference", tmp_path / "recovered"
    done = launch_deadpool(reference, flags, 2, 0, 2, [], ITERS)
    must_succeed(done)
    assert "--fim-data: the vocabulary has no <fim_prefix>" in done[0].stdout
    must_succeed(
        launch_deadpool(recovered, flags, 2, 1, 2, ["kill:rank=2:iter=3:phase=forward"], ITERS)
    )
    assert_same_run(recovered, reference, ITERS)
