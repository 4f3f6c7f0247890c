"""make demo's verdict (tools/recovery_timeline.py) is the tests': the
whole curve, not the loss alone."""

from tools.recovery_timeline import check_against_reference

REFERENCE = [
    {"iteration": i, "lm_loss": 6.0 - i / 10, "grad_norm": 1.5, "lr": 1e-3 * i} for i in (1, 2, 3)
]


def test_the_demo_passes_on_the_same_curve(capsys):
    assert check_against_reference([dict(m) for m in REFERENCE], REFERENCE, "ref/metrics.jsonl")
    assert "3 iterations compared" in capsys.readouterr().out


def test_the_demo_fails_where_only_the_grad_norm_differs(capsys):
    recovered = [dict(m) for m in REFERENCE]
    recovered[1]["grad_norm"] = 1.5000001
    assert not check_against_reference(recovered, REFERENCE, "ref/metrics.jsonl")
    assert "iteration 2" in capsys.readouterr().err


def test_the_demo_fails_on_a_missing_iteration():
    assert not check_against_reference(REFERENCE[:2], REFERENCE, "ref/metrics.jsonl")
