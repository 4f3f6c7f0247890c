"""The goodput simulator (tools/planning/goodput.py) against what can be worked out
by hand: no failures, one failure at a known time, a failure during a
restart, shrinking, spares running out, a lost mirror; against Daly's
closed form and the Young/Daly optimum; and its bookkeeping."""

import math

import pytest

from tools.planning import goodput as gp

HOUR = gp.HOUR


def accounted(out: gp.Outcome) -> float:
    return out.work_s + sum(out.spent.values())


def test_no_failures_leaves_interval_over_interval_plus_checkpoint():
    s = gp.Strategy("cr", checkpoint_interval_s=100, checkpoint_cost_s=10, restart_s=50)
    out = gp.simulate(s, [], horizon_s=50 * 110)
    assert out.failures == 0 and out.counts["checkpoints"] == 50
    assert out.ratio == pytest.approx(100 / 110, rel=1e-12)


def test_without_failures_the_mirror_costs_exactly_its_overhead():
    s = gp.Strategy("hs", 1000, 10, 50, hot_swap=True, iteration_s=5, mirror_overhead=0.01)
    out = gp.simulate(s, [], horizon_s=20 * 1010)
    assert out.ratio == pytest.approx(1000 / 1.01 / 1010, rel=1e-12)
    assert out.spent["slowdown"] == pytest.approx(20 * (1000 - 1000 / 1.01))


def test_one_failure_loses_the_work_since_the_checkpoint_and_the_restart():
    # Compute 0-100, save 100-110, compute 110-210, save 210-220, compute
    # 220-250; the failure at 250 loses 30 s of work; restart 250-300; then
    # six compute+save cycles to 960 and 40 s of compute: 840 s of work.
    s = gp.Strategy("cr", checkpoint_interval_s=100, checkpoint_cost_s=10, restart_s=50)
    out = gp.simulate(s, [250.0], horizon_s=1000)
    assert out.work_s == pytest.approx(840)
    assert out.spent["rework"] == pytest.approx(30)
    assert out.spent["recovery"] == pytest.approx(50)
    assert out.spent["checkpoint"] == pytest.approx(80)
    assert out.counts == {"checkpoints": 8, "restarts": 1}


def test_a_failure_during_the_restart_starts_it_again():
    s = gp.Strategy("cr", checkpoint_interval_s=100, checkpoint_cost_s=10, restart_s=50)
    out = gp.simulate(s, [250.0, 270.0], horizon_s=1000)
    assert out.spent["rework"] == pytest.approx(30)  # nothing more was computed
    assert out.spent["recovery"] == pytest.approx(20 + 50)
    assert out.counts["restarts_interrupted"] == 1 and out.counts["restarts"] == 1


def test_a_hot_swap_loses_only_the_interrupted_iteration():
    s = gp.Strategy("hs", hot_swap=True, iteration_s=7, swap_s=20)
    out = gp.simulate(s, [100.0], horizon_s=1000)
    assert out.spent["rework"] == pytest.approx(100 % 7)
    assert out.spent["recovery"] == pytest.approx(20)
    assert out.work_s == pytest.approx(1000 - 20 - 100 % 7)
    assert out.counts == {"swaps": 1}


def shrinking(spares: int, **changes) -> gp.Strategy:
    """Hot swap in 1 s iterations, shrinking when the spares run out."""
    return gp.Strategy(
        "shrink", hot_swap=True, iteration_s=1, spares=spares, shrink_when_out=True, **changes
    )


def test_without_a_spare_the_job_shrinks_to_dp_minus_one_replicas():
    s = shrinking(0, shrink_s=10, dp=4)
    out = gp.simulate(s, [100.5], horizon_s=1000)
    after = 1000 - 100.5 - 10
    assert out.work_s == pytest.approx(100 + after * 3 / 4)
    assert out.spent["slowdown"] == pytest.approx(after / 4)
    assert out.counts == {"shrinks": 1}


def test_a_repaired_node_grows_the_job_back():
    s = shrinking(0, shrink_s=10, regrow_s=10, dp=4, repair_mean_s=100)
    out = gp.simulate(s, [100.5], horizon_s=100_000)
    assert out.counts == {"shrinks": 1, "regrows": 1}
    assert out.ratio > 0.99  # back at full speed long before the end


def hot_swap_over_checkpoints(**changes) -> gp.Strategy:
    """Hot swap in 1 s iterations, a checkpoint every 60 s (1 s to save,
    30 s to restart from) to fall back to."""
    return gp.Strategy(
        "hs",
        checkpoint_interval_s=60,
        checkpoint_cost_s=1,
        restart_s=30,
        hot_swap=True,
        iteration_s=1,
        **changes,
    )


def test_when_spares_run_out_the_job_falls_back_to_its_checkpoint():
    s = hot_swap_over_checkpoints(swap_s=5, spares=1)
    out = gp.simulate(s, [100.0, 200.0], horizon_s=1000)
    assert out.counts["swaps"] == 1 and out.counts["fallbacks"] == 1
    assert out.counts["restarts"] == 1
    assert out.spent["recovery"] == pytest.approx(5 + 30)


def test_losing_the_buddy_during_a_swap_loses_the_mirror():
    # Save at 60-61; the failure at 100 (an iteration boundary) loses nothing;
    # the second, during the swap, takes the mirror: back to the work saved at 61.
    s = hot_swap_over_checkpoints(swap_s=50, pair_loss_probability=1.0)
    out = gp.simulate(s, [100.0, 120.0], horizon_s=1000)
    assert out.counts["pair_losses"] == 1 and out.counts["restarts"] == 1
    assert out.spent["rework"] == pytest.approx(39)
    assert out.spent["recovery"] == pytest.approx(20 + 30)


STRATEGIES = [
    gp.Strategy("cr", 1200, 30, 300),
    gp.Strategy(
        "hs",
        20_000,
        30,
        300,
        hot_swap=True,
        iteration_s=7.3,
        mirror_overhead=0.003,
        swap_s=40,
        spares=2,
        repair_mean_s=20 * HOUR,
        pair_loss_probability=0.2,
    ),
    gp.Strategy(
        "shrink",
        20_000,
        30,
        300,
        hot_swap=True,
        iteration_s=7.3,
        swap_s=40,
        spares=1,
        repair_mean_s=20 * HOUR,
        shrink_when_out=True,
        shrink_s=40,
        regrow_s=40,
        dp=8,
        pair_loss_probability=0.2,
    ),
]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_every_second_is_accounted_for_exactly_once(strategy):
    for out in gp.simulate_seeds(strategy, 1 / (5 * HOUR), 30 * gp.DAY, range(4)):
        assert out.failures > 50
        assert accounted(out) == pytest.approx(30 * gp.DAY, rel=1e-9)
        assert all(v >= -1e-6 for v in out.spent.values())


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_a_seed_gives_the_same_run_and_another_seed_another(strategy):
    a, b, c = (
        gp.simulate_seeds(strategy, 1 / (5 * HOUR), 10 * gp.DAY, [seed], trace=True)[0]
        for seed in (3, 3, 4)
    )
    assert (a.work_s, a.counts, a.trace) == (b.work_s, b.counts, b.trace)
    assert a.work_s != c.work_s


def test_the_simulation_matches_dalys_closed_form():
    mtbf, cost, restart = 10 * HOUR, 60.0, 300.0
    s = gp.Strategy("cr", gp.daly_interval(cost, mtbf), cost, restart)
    runs = gp.simulate_seeds(s, 1 / mtbf, 2000 * HOUR, range(40))
    simulated = gp.mean([o.ratio for o in runs])
    # 40 runs of ~200 failures: the mean's standard error is about 0.0005.
    assert simulated == pytest.approx(
        gp.daly_ratio(s.checkpoint_interval_s, cost, restart, mtbf), abs=0.002
    )


def test_the_hot_swap_matches_its_closed_form():
    # Iterations of 10 min and swaps of an hour against a 5 h MTBF: losing
    # the interrupted iteration and restarting a swap that a failure cuts
    # short each move the ratio by about 0.014, well beyond the tolerance.
    mtbf, iteration, swap = 5 * HOUR, 600.0, 3600.0
    s = gp.Strategy("hs", hot_swap=True, iteration_s=iteration, swap_s=swap)
    runs = gp.simulate_seeds(s, 1 / mtbf, 20_000 * HOUR, range(20))
    expected = gp.hot_swap_ratio(iteration, swap, mtbf)
    # (1/30) e^(-1/5) / (e^(1/30) - 1), worked by hand.
    assert expected == pytest.approx(0.8051, abs=1e-4)
    # 20 runs of ~4000 failures: the mean's standard error is about 0.0005.
    assert gp.mean([o.ratio for o in runs]) == pytest.approx(expected, abs=0.003)
    assert gp.hot_swap_ratio(iteration, 0.0, 1e12) == pytest.approx(1.0)


def test_young_daly_interval_minimises_the_waste():
    mtbf, cost, restart = 10 * HOUR, 60.0, 300.0
    young, daly = gp.young_interval(cost, mtbf), gp.daly_interval(cost, mtbf)
    assert young == pytest.approx(math.sqrt(2 * cost * mtbf))
    # The closed form's maximum, found numerically, is Daly's interval.
    grid = [young * (0.5 + i / 1000) for i in range(1000)]
    best = max(grid, key=lambda t: gp.daly_ratio(t, cost, restart, mtbf))
    assert best == pytest.approx(daly, rel=0.01)
    assert abs(young - best) / best < 0.05
    # The simulator agrees: the same failures waste more at half or twice it.
    ratios = {
        f: gp.mean(
            [
                o.ratio
                for o in gp.simulate_seeds(
                    gp.Strategy("cr", daly * f, cost, restart), 1 / mtbf, 2000 * HOUR, range(20)
                )
            ]
        )
        for f in (0.5, 1.0, 2.0)
    }
    assert ratios[1.0] > ratios[0.5] + 0.005 and ratios[1.0] > ratios[2.0] + 0.005


def test_daly_interval_in_its_limits():
    assert gp.daly_interval(1.0, 1e9) == pytest.approx(gp.young_interval(1.0, 1e9), rel=1e-3)
    assert gp.daly_interval(10.0, 4.0) == 4.0  # C >= 2M: checkpoint every MTBF


def test_the_share_of_failures_finding_no_spare_matches_the_queue_formula():
    rate, repair = 1 / (100 * HOUR), 50 * HOUR
    assert gp.probability_no_spare(rate, repair, 0) == 1.0
    assert gp.probability_no_spare(rate, repair, 1) == pytest.approx(1 - math.exp(-0.5))
    s = shrinking(1, repair_mean_s=repair, dp=1000)
    runs = gp.simulate_seeds(s, rate, 200_000 * HOUR, range(2))
    share = sum(o.counts.get("shrinks", 0) for o in runs) / sum(o.failures for o in runs)
    assert share == pytest.approx(gp.probability_no_spare(rate, repair, 1), abs=0.03)


def test_job_mtbf_from_llama3():
    # 419 interruptions in 54 days on 16,384 GPUs: one every ~3.1 h, ~99 h at 512.
    assert gp.job_mtbf_s(16384) / HOUR == pytest.approx(54 * 24 / 419)
    assert gp.job_mtbf_s(512) == pytest.approx(32 * gp.job_mtbf_s(16384))


def test_work_at_reads_the_trace():
    s = gp.Strategy("cr", checkpoint_interval_s=100, checkpoint_cost_s=10, restart_s=50)
    out = gp.simulate(s, [250.0], horizon_s=1000, trace=True)
    assert gp.work_at(out, [50, 105, 240, 275, 1000]) == pytest.approx([50, 100, 220, 200, 840])
