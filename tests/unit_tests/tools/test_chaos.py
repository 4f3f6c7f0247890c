"""The randomized fault campaign's draws (tools/chaos.py), in-process:
replayable from their seed, and covering the space of shapes, schedules,
mirror modes, targets, phases, spares and models. The runs themselves, with
real processes (the runs that once hung, and a seeded sample of the
campaign; the full campaign, 100 trials, is run by hand:
docs/reliability.md), are in tests/functional_tests/test_chaos.py.
"""

from tools import chaos


def test_the_draws_are_replayable_and_cover_the_space():
    draws = [chaos.draw(1, i) for i in range(100)]
    assert draws == [chaos.draw(1, i) for i in range(100)]
    assert {(t.tp, t.pp) for t in draws} == set(chaos.SHAPES)
    assert {t.virtual_stages for t in draws if t.pp == 2} == {1, 2}
    assert {t.virtual_stages for t in draws if t.pp != 2} == {1}
    assert {t.mirror_mode for t in draws} == {"state", "grad"}
    assert {t.target for t in draws} == {"rank", "node", "rank+buddy"}
    assert {t.phase for t in draws} == set(chaos.PHASES)
    assert {t.spares for t in draws} == {0, 1} and {t.model for t in draws} == set(
        chaos.DRAWN_MODELS
    )
    assert any(t.delay_ms == 0 for t in draws) and max(t.delay_ms for t in draws) > 100
