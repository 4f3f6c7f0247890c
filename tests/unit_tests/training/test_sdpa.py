"""torch's scaled_dot_product_attention as megatron-core's core attention
(megatron/training/sdpa.py), in-process. A real tensor-parallel run with
SDPA and dropout is in tests/functional_tests/test_sdpa.py.

The SDPA module must compute what megatron-core's DotProductAttention
computes, forward and backward, up to the rounding of fp32 (one kernel
fuses what the other does in three): within TOLERANCE, with a negative
control showing that a real difference (a mask left out, a scale off by
1%) lands far outside it.
"""

import contextlib
import types

import pytest
import torch

from megatron.training import cpu_compat

cpu_compat.import_megatron_core_without_cuda()  # import-time only

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.fusions import fused_softmax  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnBackend, AttnMaskType  # noqa: E402

from megatron.training.sdpa import TorchSdpaAttention, with_core_attention  # noqa: E402

# Largest difference allowed, relative to the largest value compared: a
# few hundred fp32 ulps, for sums over 64 keys taken in another order.
TOLERANCE = 2e-6
SEQ, BATCH, HEADS, DIM = 64, 2, 8, 16
ONE_RANK = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))


class HostBuffer:
    """megatron-core's global scratch buffer, on the host."""

    def get_tensor(self, shape, dtype, name):
        return torch.empty(shape, dtype=dtype)


class HostTracker:
    """The model-parallel RNG tracker's contract on the host: ``fork()``
    swaps the default generator to the tracker's stream and back."""

    def __init__(self, seed: int):
        self.state = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self):
        outside = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outside)


@pytest.fixture(autouse=True)
def on_the_host(monkeypatch):
    """What megatron-core's attention asks of CUDA, answered on the host for
    this test only (cpu_compat's patches are process-wide)."""
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", HostBuffer)
    monkeypatch.setattr(
        fused_softmax,
        "get_default_causal_mask",
        lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1),
    )
    tracker = HostTracker(1234)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: tracker)
    return tracker


def config(groups: int = HEADS, dropout: float = 0.0, backend=AttnBackend.unfused):
    return TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=groups,
        attention_dropout=dropout,
        masked_softmax_fusion=False,
        attention_backend=backend,
    )


def inputs(groups: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(SEQ, BATCH, HEADS, DIM), (SEQ, BATCH, groups, DIM), (SEQ, BATCH, groups, DIM)]
    return [torch.randn(s, generator=generator, requires_grad=True) for s in shapes]


def document_mask() -> torch.Tensor:
    """megatron's form (True: hidden) of a causal mask reset at a document
    boundary, as --reset-attention-mask makes: tokens 40- see only 40-."""
    hidden = torch.ones(SEQ, SEQ).triu(1).bool()
    hidden[40:, :40] = True
    return hidden.expand(BATCH, 1, SEQ, SEQ)


def outputs_and_grads(module, q, k, v, mask):
    out = module(q, k, v, mask)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view_as(out))
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return [out.detach(), *grads]


def largest_difference(a, b) -> float:
    return max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(a, b))


def both(groups: int, mask, backend=AttnBackend.unfused):
    cfg = config(groups, backend=backend)
    q, k, v = inputs(groups)
    local = DotProductAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=ONE_RANK)
    sdpa = TorchSdpaAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=ONE_RANK)
    return outputs_and_grads(sdpa, q, k, v, mask), outputs_and_grads(local, q, k, v, mask)


@pytest.mark.parametrize("groups", [HEADS, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize(
    "backend, masked",
    [
        (AttnBackend.unfused, False),
        (AttnBackend.unfused, True),
        (AttnBackend.auto, False),
        (AttnBackend.auto, True),
        (AttnBackend.flash, False),  # the flash kernel takes no mask (refused at parse time)
    ],
)
def test_sdpa_equals_megatron_core_attention(groups, masked, backend):
    got, want = both(groups, document_mask() if masked else None, backend)
    assert got[0].shape == (SEQ, BATCH, HEADS * DIM)
    assert largest_difference(got, want) < TOLERANCE


def test_a_real_difference_lands_outside_the_tolerance():
    """Negative controls: the comparison above can fail."""
    got, want = both(2, document_mask())
    causal_only, _ = both(2, None)  # the document boundary ignored
    assert largest_difference(causal_only, want) > 100 * TOLERANCE
    cfg = config(2)
    off = TorchSdpaAttention(
        cfg, 1, AttnMaskType.causal, "self", softmax_scale=1.01 / DIM**0.5, pg_collection=ONE_RANK
    )
    scaled = outputs_and_grads(off, *inputs(2), document_mask())
    assert largest_difference(scaled, want) > 100 * TOLERANCE
    assert largest_difference(got, want) < TOLERANCE


def test_dropout_draws_from_the_model_parallel_stream(on_the_host):
    """Masks come from the tracker's stream, as megatron-core's attention
    (each TP rank its own heads' masks): the default stream is untouched,
    the same tracker state gives the same masks, and dropout is applied in
    training only."""
    sdpa = TorchSdpaAttention(
        config(dropout=0.5), 1, AttnMaskType.causal, "self", pg_collection=ONE_RANK
    )
    q, k, v = inputs(HEADS)
    tracker_state, default_state = on_the_host.state, torch.get_rng_state()
    first = sdpa(q, k, v, None)
    assert torch.equal(torch.get_rng_state(), default_state)
    assert not torch.equal(on_the_host.state, tracker_state)
    on_the_host.state = tracker_state
    assert torch.equal(sdpa(q, k, v, None), first)
    plain = TorchSdpaAttention(config(), 1, AttnMaskType.causal, "self", pg_collection=ONE_RANK)
    assert not torch.allclose(first, plain(q, k, v, None))
    sdpa.eval()
    assert torch.equal(sdpa(q, k, v, None), plain(q, k, v, None))


def core_attentions(spec) -> list:
    layers = getattr(spec, "layer_specs", None) or [spec]
    return [layer.submodules.self_attention.submodules.core_attention for layer in layers]


def test_the_spec_gets_sdpa_in_every_layer_and_the_original_is_kept():
    dense = get_gpt_layer_local_spec()
    assert core_attentions(with_core_attention(dense, TorchSdpaAttention)) == [TorchSdpaAttention]
    assert core_attentions(dense) == [DotProductAttention]
    moe_config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=2
    )
    block = get_gpt_decoder_block_spec(moe_config, use_transformer_engine=False, pp_rank=0)
    swapped = with_core_attention(block, TorchSdpaAttention)
    assert core_attentions(swapped) == [TorchSdpaAttention] * 2
    assert core_attentions(block) == [DotProductAttention] * 2
