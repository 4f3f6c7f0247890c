"""Pure-function tests: layout-invariant init names and slices, Megatron's
sample order, document splits, the log lines, and the megatron namespace."""

import math
import os
import re
import sysconfig

import pytest
import torch

from megatron.training import data, log
from megatron.training.data import MicrobatchSampler, documents_per_split, microbatch_indices
from megatron.training.layout_invariant_init import global_name, tp_slice

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- global_name ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "local, pp_rank, per_stage, expected",
    [
        (
            "decoder.layers.0.self_attention.linear_qkv.weight",
            0,
            2,
            "decoder.layers.0.self_attention.linear_qkv.weight",
        ),
        (
            "decoder.layers.0.self_attention.linear_qkv.weight",
            1,
            2,
            "decoder.layers.2.self_attention.linear_qkv.weight",
        ),
        ("decoder.layers.1.mlp.linear_fc1.weight", 3, 2, "decoder.layers.7.mlp.linear_fc1.weight"),
        ("decoder.layers.1.mlp.linear_fc2.bias", 2, 5, "decoder.layers.11.mlp.linear_fc2.bias"),
        (
            "decoder.layers.9.input_layernorm.weight",
            1,
            10,
            "decoder.layers.19.input_layernorm.weight",
        ),
        # Not a layer: unchanged on any stage.
        ("decoder.final_layernorm.weight", 3, 2, "decoder.final_layernorm.weight"),
        ("embedding.word_embeddings.weight", 0, 2, "embedding.word_embeddings.weight"),
        ("embedding.position_embeddings.weight", 0, 2, "embedding.position_embeddings.weight"),
    ],
)
def test_global_name_offsets_layers_by_stage(local, pp_rank, per_stage, expected):
    assert global_name(local, pp_rank * per_stage, tied=True) == expected
    assert global_name(local, pp_rank * per_stage, tied=False) == expected


def test_global_name_distinct_across_stages():
    """Every (stage, local layer) pair maps to its own global layer."""
    names = {
        global_name(f"decoder.layers.{i}.mlp.linear_fc1.weight", stage * 3, tied=False)
        for stage in range(4)
        for i in range(3)
    }
    assert names == {f"decoder.layers.{k}.mlp.linear_fc1.weight" for k in range(12)}


def test_global_name_tied_output_layer_is_the_embedding():
    assert global_name("output_layer.weight", 6, tied=True) == "embedding.word_embeddings.weight"
    assert global_name("output_layer.weight", 0, tied=True) == "embedding.word_embeddings.weight"


def test_global_name_untied_output_layer_keeps_its_name():
    assert global_name("output_layer.weight", 6, tied=False) == "output_layer.weight"
    # Only the weight is the tied one.
    assert global_name("output_layer.bias", 6, tied=True) == "output_layer.bias"


# --- tp_slice ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, dim, tp", [((8, 3), 0, 2), ((8, 3), 0, 4), ((3, 12), 1, 3), ((6, 4), 0, 1)]
)
def test_tp_slice_plain_concatenates_back(shape, dim, tp):
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    slices = [tp_slice(full, dim, r, tp, gated=False) for r in range(tp)]
    size = shape[dim] // tp
    for r, piece in enumerate(slices):
        assert piece.shape[dim] == size
        assert torch.equal(piece, full.narrow(dim, r * size, size))
    assert torch.equal(torch.cat(slices, dim=dim), full)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_slice_gated_takes_rank_slice_of_gate_and_up(tp):
    ffn, hidden = 8, 3
    gate = torch.arange(ffn * hidden, dtype=torch.float32).reshape(ffn, hidden)
    up = -1000 - gate
    full = torch.cat([gate, up], dim=0)  # fc1 of SwiGLU: [gate; up]
    size = ffn // tp
    for r in range(tp):
        piece = tp_slice(full, 0, r, tp, gated=True)
        assert piece.shape == (2 * size, hidden)
        # Rank r's slice of the gate, then rank r's slice of up.
        assert torch.equal(piece[:size], gate[r * size : (r + 1) * size])
        assert torch.equal(piece[size:], up[r * size : (r + 1) * size])
    if tp > 1:
        # Not the plain slice (which would be all gate on rank 0).
        assert not torch.equal(
            tp_slice(full, 0, 0, tp, gated=True), tp_slice(full, 0, 0, tp, gated=False)
        )
    # Each rank's local [gate_r; up_r] chunks back into the full gate and up.
    pieces = [tp_slice(full, 0, r, tp, gated=True).chunk(2, dim=0) for r in range(tp)]
    assert torch.equal(torch.cat([g for g, _ in pieces]), gate)
    assert torch.equal(torch.cat([u for _, u in pieces]), up)


# --- sample order --------------------------------------------------------------------


def megatron_pretraining_sampler(
    total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
):
    """Megatron-LM's MegatronPretrainingSampler (drop_last=True), as a reference."""
    step = micro_batch_size * data_parallel_size
    batch = []
    for idx in range(consumed_samples, total_samples):
        batch.append(idx)
        if len(batch) == step:
            start = data_parallel_rank * micro_batch_size
            yield batch[start : start + micro_batch_size]
            batch = []


LAYOUTS = [(1, 1, 1), (2, 1, 3), (1, 4, 2), (2, 2, 2), (3, 2, 4), (4, 8, 1)]  # mbs, dp, n_micro


@pytest.mark.parametrize("mbs, dp, n_micro", LAYOUTS)
@pytest.mark.parametrize("iteration", [0, 1, 5])
def test_iteration_covers_its_samples_exactly_once(mbs, dp, n_micro, iteration):
    gbs = mbs * dp * n_micro
    consumed = iteration * gbs
    seen = [
        i
        for k in range(n_micro)
        for r in range(dp)
        for i in microbatch_indices(consumed, k, mbs, r, dp)
    ]
    assert sorted(seen) == list(range(consumed, consumed + gbs))
    assert len(set(seen)) == len(seen)


@pytest.mark.parametrize("mbs, dp, n_micro", LAYOUTS)
def test_microbatch_indices_follow_megatron_order(mbs, dp, n_micro):
    gbs = mbs * dp * n_micro
    for r in range(dp):
        reference = list(megatron_pretraining_sampler(3 * gbs, 0, mbs, r, dp))
        ours = [
            microbatch_indices(it * gbs, k, mbs, r, dp) for it in range(3) for k in range(n_micro)
        ]
        assert ours == reference


def test_microbatch_indices_example():
    # mbs 2, DP 2: chunk k is samples [4k, 4k+4), rank 0 takes the first half.
    assert microbatch_indices(0, 0, 2, 0, 2) == [0, 1]
    assert microbatch_indices(0, 0, 2, 1, 2) == [2, 3]
    assert microbatch_indices(0, 1, 2, 0, 2) == [4, 5]
    assert microbatch_indices(8, 1, 2, 1, 2) == [14, 15]


@pytest.mark.parametrize(
    "total, mbs, dp", [(40, 2, 2), (37, 3, 2), (16, 1, 4), (10, 4, 1), (5, 3, 2)]
)
@pytest.mark.parametrize("consumed", [0, 6, 12])
def test_sampler_matches_megatron(total, mbs, dp, consumed):
    for r in range(dp):
        sampler = MicrobatchSampler(total, consumed, mbs, r, dp)
        reference = list(megatron_pretraining_sampler(total, consumed, mbs, r, dp))
        assert list(sampler) == reference
        assert len(sampler) == len(reference)


@pytest.mark.parametrize("mbs, dp", [(2, 2), (1, 3), (4, 1)])
def test_sampler_resumed_is_the_tail(mbs, dp):
    step = mbs * dp
    total = 25 * step + 1  # a ragged end is dropped either way
    for r in range(dp):
        full = list(MicrobatchSampler(total, 0, mbs, r, dp))
        assert len(full) == 25
        for k in (0, 1, 7, 24, 25):
            resumed = MicrobatchSampler(total, k * step, mbs, r, dp)
            assert list(resumed) == full[k:]
            assert len(resumed) == len(full) - k


# --- document splits -----------------------------------------------------------------


def megatron_core_documents_per_split(num_documents, split):
    """How megatron-core's builder actually cuts a low-level dataset."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [
        0
        if b is None
        else int(round(b[1] * float(num_documents))) - int(round(b[0] * float(num_documents)))
        for b in matrix
    ]


SPLITS = [
    "969,30,1",
    "98,2,0",
    "1,1,1",
    "99,1",
    "949,50,1",
    "1,0,0",
    "0,1,0",
    "2,1,1",
    "8,1,1",
    "0.5,0.3,0.2",
    "100,0,0",
    "3/1/1",
]


@pytest.mark.parametrize("split", SPLITS)
def test_documents_per_split_sums_to_documents(split):
    weights = data.split_weights(split)
    for n in list(range(0, 50)) + [999, 1000, 12345]:
        counts = documents_per_split(n, weights)
        assert len(counts) == 3
        assert sum(counts) == n, (n, split, counts)
        assert all(c >= 0 for c in counts)
        # A zero weight gets no document.
        assert all(c == 0 for c, w in zip(counts, weights) if w == 0)


def test_documents_per_split_examples():
    assert documents_per_split(3, [98, 1, 1]) == [3, 0, 0]
    assert documents_per_split(3, [1, 1, 1]) == [1, 1, 1]
    assert documents_per_split(1000, [969, 30, 1]) == [969, 30, 1]
    assert documents_per_split(100, [969, 30, 1]) == [97, 3, 0]


@pytest.mark.parametrize("split", SPLITS)
def test_documents_per_split_matches_megatron_core_common_splits(split):
    for n in (1, 2, 3, 4, 5, 7, 10, 20, 100, 1000):
        assert documents_per_split(
            n, data.split_weights(split)
        ) == megatron_core_documents_per_split(n, split), (n, split)


@pytest.mark.parametrize(
    "n, split", [(11, "15,7,0"), (173, "0.9,0.9,0"), (30, "90,5,5"), (10, "47,8,45")]
)
def test_documents_per_split_matches_megatron_core_at_rounding_boundaries(n, split):
    assert documents_per_split(n, data.split_weights(split)) == megatron_core_documents_per_split(
        n, split
    )


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


# --- the megatron namespace ----------------------------------------------------------


def test_megatron_is_a_namespace_of_the_wheel_and_the_repo():
    import megatron
    import megatron.core
    import megatron.training

    site = {
        os.path.realpath(p)
        for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])
    }
    core = os.path.realpath(megatron.core.__file__)
    assert "site-packages" in core.split(os.sep)
    assert any(core.startswith(s + os.sep) for s in site), core
    # Not our tree (a venv inside the checkout is fine: that is site-packages).
    assert not core.startswith(os.path.realpath(os.path.join(REPO, "megatron")) + os.sep)
    training = os.path.realpath(megatron.training.__file__)
    ours = os.path.realpath(os.path.join(REPO, "megatron", "training"))
    assert training.startswith(ours + os.sep)
    assert not os.path.exists(os.path.join(REPO, "megatron", "__init__.py"))
    assert not os.path.exists(os.path.join(REPO, "megatron", "core"))
    assert getattr(megatron, "__file__", None) is None  # a namespace package
    paths = {os.path.realpath(p) for p in megatron.__path__}
    assert os.path.realpath(os.path.join(REPO, "megatron")) in paths


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


def test_skipped_and_nan_iterations_are_counted_per_log_interval():
    from megatron.training.training import _LogWindow

    window = _LogWindow()
    window.add(1.0, {"lm loss": float("nan")}, skipped=True)
    window.add(1.0, {"lm loss": 2.0}, skipped=True)
    assert (window.iterations, window.skipped, window.nans) == (2, 2, 1)
    window.__init__()  # what the log line does after printing
    window.add(1.0, {"lm loss": 2.0}, skipped=False)
    assert (window.skipped, window.nans) == (0, 0)
