"""Which attention a run gets (megatron/training/attention.py): the backend,
Transformer Engine and the device decide it, and the backends that cannot
run here are refused with what to change."""

import pytest

from megatron.training import cpu_compat

cpu_compat.import_megatron_core_without_cuda()  # import-time only

from megatron.training.attention import (  # noqa: E402
    LOCAL,
    SDPA,
    TE,
    attention_problem,
    core_attention_kind,
)


@pytest.mark.parametrize(
    "backend, uses_te, on_cpu, kind",
    [
        ("auto", True, False, TE),
        ("flash", True, False, TE),
        ("auto", False, False, SDPA),  # a GPU without Transformer Engine
        ("auto", False, True, LOCAL),  # CPU: megatron-core's, as before
        ("local", False, False, LOCAL),
        ("flash", False, True, SDPA),
        ("fused", False, False, SDPA),
        ("unfused", False, True, SDPA),
    ],
)
def test_which_attention_a_run_gets(backend, uses_te, on_cpu, kind):
    assert core_attention_kind(backend, uses_te, on_cpu) == kind


def test_backends_that_cannot_run_here_are_refused_with_what_to_change():
    assert "--transformer-impl local" in attention_problem("local", True, False, 0.1)
    assert "needs a GPU" in attention_problem("fused", False, True, 0.0)
    assert "--attention-dropout 0" in attention_problem("flash", False, True, 0.1)
    assert attention_problem("flash", False, True, 0.0) is None
    assert attention_problem("flash", False, False, 0.1) is None  # GPU flash has dropout
    assert attention_problem("fused", False, False, 0.1) is None
    mask = "--reset-attention-mask"
    assert mask in attention_problem("flash", False, False, 0.0, masked_by=mask)
    assert attention_problem("unfused", False, True, 0.1, masked_by=mask) is None
    mla = "multi-latent attention's head dimensions"
    assert core_attention_kind("auto", False, True, local_lacks=mla) == "sdpa"
    assert mla in attention_problem("local", False, True, 0.1, local_lacks=mla)
    assert attention_problem("flash", False, True, 0.0, local_lacks=mla) is None
