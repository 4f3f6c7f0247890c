"""torch's scaled_dot_product_attention (megatron/training/sdpa.py) in a
real run: pretrain_gpt.py on two tensor-parallel ranks with SDPA and
dropout trains and repeats bit for bit. (The module against megatron-core's
attention, and which attention a run gets, in-process, are in
tests/unit_tests/training/test_sdpa.py and test_attention.py.)"""

import pytest

from dist_utils import TINY_GPT, curve, read_metrics, run_pretrain

pytestmark = pytest.mark.integration


def test_a_tensor_parallel_run_with_sdpa_and_dropout_trains_and_repeats_bit_for_bit(
    tmp_path, corpus_prefix
):
    """pretrain_gpt.py with --attention-backend unfused (SDPA's math kernel)
    and Megatron's default dropout on TP2: the loss falls, and a second run
    gives every iteration's loss, grad norm and lr bit for bit, which a hot
    swap's redone iteration needs of the attention's dropout masks."""
    curves = []
    for run in ("a", "b"):
        metrics = tmp_path / f"{run}.jsonl"
        output = run_pretrain(
            2,
            TINY_GPT
            + ["--tensor-model-parallel-size", "2", "--attention-backend", "unfused"]
            + ["--global-batch-size", "4", "--train-iters", "6", "--data-path", corpus_prefix]
            + ["--metrics-file", str(metrics)],
        )
        curves.append(curve(read_metrics(metrics)))
        assert "core attention: TorchSdpaAttention (--attention-backend unfused)" in output
    assert [c[0] for c in curves[0]] == list(range(1, 7))
    assert curves[0][-1][1] < curves[0][0][1]
    assert curves[0] == curves[1]
