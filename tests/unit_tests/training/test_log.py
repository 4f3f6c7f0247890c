"""The training log (megatron/training/log.py): the iteration and validation
lines are Megatron-LM's, and the throughput's FLOPs are Megatron-LM's
count (causal attention, multi-latent attention, routed and shared experts,
dense layers and multi-token prediction)."""

import math
import re

import pytest

from megatron.training import log
from megatron.training.arguments import parse_args
from tests.unit_tests.training.flags.test_moe import BASE, MOE


# --- arithmetic -------------------------------------------------------------------


def test_throughput_counts_the_routed_and_shared_experts_as_megatron_lm():
    config = parse_args(
        BASE
        + MOE
        + ["--moe-router-topk", "2", "--moe-ffn-hidden-size", "96"]
        + ["--moe-shared-expert-intermediate-size", "32"],
        world_size=1,
    )
    config.run.padded_vocab_size = 128
    h, s, layers, gbs = 64, 32, 2, 8
    # Megatron-LM's transformer_flops, term by term: 3 (fwd+bwd) x 2 (FMA) x h x
    # (routed experts: moe_ffn x topk x 2 GEMMs, shared: its width x 2) ...
    mlp = 3 * 2 * h * (96 * 2 * 2 + 32 * 2)
    attention = 3 * 2 * (h * (64 + 64 + 64) + 64 * s / 2 * 2 + 64 * h)
    logits = 3 * 2 * h * 128
    expected = gbs * s * (layers * (mlp + attention) + logits)
    assert log.flops_per_iteration(config, gbs) == expected


def test_throughput_counts_dense_layers_and_multi_token_prediction_as_megatron_lm():
    """Megatron-LM's transformer_flops with --moe-layer-freq and MTP, term by
    term: a dense first layer, an MoE second, one MTP layer like the last
    (MoE), the MTP layer's two norms (3h) and projection (2h x h), and the
    logits once more."""
    config = parse_args(
        BASE
        + MOE
        + ["--moe-router-topk", "2", "--moe-ffn-hidden-size", "96"]
        + ["--moe-layer-freq", "[0,1]", "--mtp-num-layers", "1"]
        + ["--position-embedding-type", "rope"],
        world_size=1,
    )
    config.run.padded_vocab_size = 128
    h, s, gbs, ffn = 64, 32, 8, 256
    dense, routed = 3 * 2 * h * ffn * 2, 3 * 2 * h * 96 * 2 * 2
    attention = 3 * 2 * (h * (64 + 64 + 64) + 64 * s / 2 * 2 + 64 * h)
    mtp = 3 * 2 * 1 * (3 * h + 2 * h * h)
    logits = 3 * 2 * h * 128 * 2
    expected = gbs * s * (dense + 2 * routed + 3 * attention + mtp + logits)
    assert log.flops_per_iteration(config, gbs) == expected


# --- log lines -----------------------------------------------------------------------

TIMESTAMP = r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(\.\d{1,6})?\]"

EXAMPLE = (
    " iteration       71/     100 | consumed samples:         9088 |"
    " elapsed time per iteration (ms): 5361.6 | learning rate: 1.420000E-05 |"
    " global batch size:   128 | lm loss: 1.818812E+00 | loss scale: 1.0 |"
    " grad norm: 1.300 | number of skipped iterations:   0 |"
    " number of nan iterations:   0 |"
)


def _strip_timestamp(line):
    match = re.match(TIMESTAMP, line)
    assert match, f"no Megatron timestamp at the start of {line!r}"
    return line[match.end() :]


def _example_line(**overrides):
    kwargs = dict(
        iteration=71,
        train_iters=100,
        consumed_samples=9088,
        elapsed_ms=5361.6,
        learning_rate=1.42e-05,
        global_batch_size=128,
        losses={"lm loss": 1.818812},
        loss_scale=1.0,
        grad_norm=1.3,
        skipped=0,
        nans=0,
    )
    kwargs.update(overrides)
    return log.training_log_line(**kwargs)


def test_training_log_line_matches_megatron_exactly():
    assert _strip_timestamp(_example_line()) == EXAMPLE


def test_training_log_line_regex():
    pattern = (
        TIMESTAMP + r" iteration +(\d+)/ +(\d+) \| consumed samples: +(\d+) \|"
        r" elapsed time per iteration \(ms\): (\d+\.\d) \|"
        r" learning rate: (\d\.\d{6}E[+-]\d\d) \| global batch size: +(\d+) \|"
        r" lm loss: (\d\.\d{6}E[+-]\d\d) \| loss scale: (\d+\.\d) \|"
        r" grad norm: (\d+\.\d{3}) \| number of skipped iterations: +(\d+) \|"
        r" number of nan iterations: +(\d+) \|$"
    )
    line = _example_line(
        iteration=3,
        train_iters=12345,
        consumed_samples=24,
        elapsed_ms=12.345,
        learning_rate=3e-4,
        global_batch_size=8,
        losses={"lm loss": 10.5},
        loss_scale=65536.0,
        grad_norm=12.3456,
        skipped=2,
        nans=1,
    )
    match = re.match(pattern, line)
    assert match, line
    assert match.groups()[1:] == (
        "3",
        "12345",
        "24",
        "12.3",
        "3.000000E-04",
        "8",
        "1.050000E+01",
        "65536.0",
        "12.346",
        "2",
        "1",
    )
    # Widths as Megatron's: iteration fields 8 wide, samples 12, batch 5, counters 3.
    body = _strip_timestamp(line)
    assert body.startswith(" iteration        3/   12345 | consumed samples:           24 |")
    assert " global batch size:     8 |" in body
    assert body.endswith(" number of skipped iterations:   2 | number of nan iterations:   1 |")


def test_training_log_line_optional_fields():
    body = _strip_timestamp(_example_line(grad_norm=None))
    assert "grad norm" not in body
    assert body == EXAMPLE.replace(" grad norm: 1.300 |", "")
    body = _strip_timestamp(_example_line(tflops=123.456))
    assert body == EXAMPLE.replace(
        " elapsed time per iteration (ms): 5361.6 |",
        " elapsed time per iteration (ms): 5361.6 | throughput per GPU (TFLOP/s/GPU): 123.5 |",
    )
    body = _strip_timestamp(_example_line(losses={"lm loss": 2.0, "z loss": 0.5}))
    assert " lm loss: 2.000000E+00 | z loss: 5.000000E-01 | loss scale: 1.0 |" in body


@pytest.mark.parametrize("loss", [1.818812, 0.0, 5.5, 19.9, 20.0, 25.0, 1000.0])
def test_validation_log_line(loss):
    line = log.validation_log_line("iteration 5", {"lm loss": loss})
    match = re.fullmatch(
        r" validation loss at iteration 5 \| lm loss value: (\S+) \|"
        r" lm loss PPL: (\S+) \|\s*",
        line,
    )
    assert match, line
    value, ppl = match.groups()
    assert value == f"{loss:.6E}"
    assert ppl == f"{math.exp(min(20, loss)):.6E}"
    assert re.fullmatch(r"\d\.\d{6}E[+-]\d\d", ppl)
    if loss >= 20:
        assert ppl == "4.851652E+08"  # exp(20): PPL is capped


def test_validation_log_line_example():
    line = log.validation_log_line("iteration 5", {"lm loss": 2.0})
    assert line.rstrip() == (
        " validation loss at iteration 5 | lm loss value: 2.000000E+00 |"
        " lm loss PPL: 7.389056E+00 |"
    )


def test_flops_are_megatron_lms_count_with_causal_attention():
    """Megatron-LM's transformer_flops for a dense GPT with GQA and SwiGLU,
    written out term by term: 3 passes x 2 FLOPs per multiply-add x tokens x
    (per layer: QKV and output projections, QK^T and (QK^T)V over half the
    positions, the MLP; then the logits)."""
    from megatron.training.log import flops_per_iteration

    h, s, layers, heads, groups, ffn, vocab, gbs = 256, 1024, 4, 8, 2, 704, 1024, 16
    from megatron.training.arguments import parse_args

    flags = {
        "num-layers": layers,
        "hidden-size": h,
        "num-attention-heads": heads,
        "num-query-groups": groups,
        "ffn-hidden-size": ffn,
        "seq-length": s,
        "micro-batch-size": 1,
        "global-batch-size": gbs,
        "train-iters": 1,
        "lr": 1,
        "tokenizer-type": "ByteLevelTokenizer",
    }
    argv = [item for name, value in flags.items() for item in (f"--{name}", str(value))]
    argv += ["--group-query-attention", "--swiglu", "--mock-data"]
    config = parse_args(argv, world_size=1)
    config.run.padded_vocab_size = vocab
    kv = h // heads * groups
    per_layer = h * (h + 2 * kv) + h * s / 2 * 2 + h * h + 3 * h * ffn
    assert flops_per_iteration(config, gbs) == 3 * 2 * gbs * s * (layers * per_layer + h * vocab)


def test_flops_of_multi_latent_attention_are_megatron_lms_count():
    """Megatron-LM's MLA term at its CI config's sizes (gpt3_mcore_te_tp2_pp2_mla),
    written out: query low-rank projection (with its norm), key-value one
    (with its norm) and the shared rope key, output projection, then QK^T
    and (QK^T)V over half the positions."""
    from megatron.training.arguments import parse_args
    from megatron.training.log import flops_per_iteration

    h, s, layers, heads, vocab, gbs = 512, 1024, 4, 8, 1024, 32
    q_rank, kv_rank, qk, pos, v = 192, 64, 16, 8, 16
    flags = {
        "num-layers": layers,
        "hidden-size": h,
        "num-attention-heads": heads,
        "seq-length": s,
        "micro-batch-size": 4,
        "global-batch-size": gbs,
        "train-iters": 1,
        "lr": 1,
        "tokenizer-type": "ByteLevelTokenizer",
        "q-lora-rank": q_rank,
        "kv-lora-rank": kv_rank,
        "qk-head-dim": qk,
        "qk-pos-emb-head-dim": pos,
        "v-head-dim": v,
    }
    argv = [item for name, value in flags.items() for item in (f"--{name}", str(value))]
    config = parse_args(argv + ["--multi-latent-attention", "--mock-data"], world_size=1)
    config.run.padded_vocab_size = vocab
    attention = (
        q_rank * (h + heads * (qk + pos) + 1)
        + kv_rank * (h + heads * (qk + v) + 1)
        + h * pos
        + heads * v * h
        + s * heads * (qk + pos) / 2
        + s * heads * v / 2
    )
    per_layer = attention + 2 * h * 4 * h
    assert flops_per_iteration(config, gbs) == 3 * 2 * gbs * s * (layers * per_layer + h * vocab)
