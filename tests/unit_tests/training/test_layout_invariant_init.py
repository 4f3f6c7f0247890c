"""Layout-invariant initialisation (megatron/training/layout_invariant_init.py):
each parameter's global name whatever its pipeline stage or expert-parallel
rank, and its tensor-parallel slice."""

import math

import pytest
import torch

from megatron.training import layout_invariant_init
from megatron.training.layout_invariant_init import global_name, tp_slice


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


def test_an_expert_parallel_ranks_local_experts_have_their_global_names():
    local = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    assert layout_invariant_init.global_name(local, 2, False, expert_offset=2) == (
        "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"
    )
