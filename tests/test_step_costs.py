"""The MTP cost model (engine/step_costs.py): pure arithmetic over measured costs."""

from __future__ import annotations

import pytest

from mtplx.engine.step_costs import StepCosts, host_per_step, measure, median_of
from mtplx.events import RequestStats

FLAT = {t: 1.0 for t in range(1, 6)}  # a verify costs one step: dispatch-bound
LINEAR = {t: float(t) for t in range(1, 6)}  # a verify costs k+1 steps: compute-bound


def test_tau_and_speedup_follow_acceptance_and_costs():
    costs = StepCosts(FLAT, draft=0.25)
    acceptance = [0.9, 0.8, 0.7, 0.6]
    assert costs.tau(2, acceptance) == pytest.approx(2.7)
    assert costs.speedup(2, acceptance) == pytest.approx(2.7 / 1.5)
    # depth 4: 4.0 / 2.0 = 2.0, within 5% of depth 3's 3.4 / 1.75 = 1.94: the shallower one
    assert costs.best_depth(acceptance) == 3
    assert costs.best_depth([0.95, 0.95, 0.95, 0.95]) == 4  # 4.8 / 2.0 = 2.4 against 3.85 / 1.75 = 2.2
    assert costs.best_depth([0.9, 0.1, 0.0, 0.0]) == 1


def test_no_depth_when_verifying_costs_as_much_as_decoding():
    assert StepCosts(LINEAR, draft=0.3).best_depth([0.9, 0.9, 0.9, 0.9]) is None


def test_host_time_per_step_favours_speculation():
    costs = StepCosts(LINEAR, draft=0.1)
    assert costs.best_depth([0.95, 0.9, 0.85, 0.8]) is None
    slow_host = costs.with_host(2.0)
    assert slow_host.speedup(1, [0.95]) == pytest.approx(1.95 * 3.0 / (0.1 + 2.0 + 2.0))
    assert slow_host.best_depth([0.95, 0.9, 0.85, 0.8]) is not None
    assert costs.with_host(-0.5).host == 0.0


def test_host_per_step_from_ar_stats():
    ar = RequestStats(mode="ar", completion_tokens=10, decode_s=1.0, verify_s=0.7, sample_s=0.1)
    assert host_per_step(ar) == pytest.approx(0.02)
    with pytest.raises(ValueError):
        host_per_step(RequestStats(mode="mtp", depth=2, completion_tokens=10, decode_s=1.0))


def test_invalid_costs_are_refused():
    with pytest.raises(ValueError):
        StepCosts({1: 1.0, 2: 1.0}, draft=0.2)
    with pytest.raises(ValueError):
        StepCosts(FLAT, draft=0.0)
    with pytest.raises(ValueError):
        StepCosts(FLAT, draft=0.2).tau(3, [0.9])


def test_measure_gives_every_cost_on_both_models(engine):
    costs = engine.call(lambda: measure(engine.runner, list(range(10, 60)), reps=2))
    assert set(costs.forward) == {1, 2, 3, 4, 5} and costs.draft > 0 and costs.host == 0.0
    assert set(costs.rounds) == {1, 2, 3, 4} and all(v > 0 for v in costs.rounds.values())


def test_a_timed_round_replaces_the_sum_of_its_parts():
    costs = StepCosts(FLAT, draft=0.25, rounds={1: 1.1, 2: 1.2})
    assert costs.round_s(1) == pytest.approx(1.1) and costs.round_s(3) == pytest.approx(1.75)
    assert costs.chained_draft(2) == pytest.approx(0.1) and costs.chained_draft(3) is None
    assert median_of([costs, StepCosts(LINEAR, draft=0.5, rounds={1: 2.0, 2: 3.0})]).rounds[2] == pytest.approx(2.1)


def test_the_tuner_keeps_the_modelled_depth_unless_a_measured_arm_is_clearly_faster():
    from mtplx.tuning import choose_depth

    # tok/s per round (every arm decodes a round's prompt back to back)
    speeds = {"ar": [158.0, 150.0, 170.0], "depth 1": [243.5, 230.0, 250.0], "depth 2": [183.7, 190.0, 180.0],
              "depth 3": [173.7, 170.0, 175.0], "depth 4": [139.0, 140.0, 150.0]}
    assert choose_depth(3, speeds) == 1  # the hybrid run: all depths predicted alike, depth 1 measured best
    assert choose_depth(1, speeds) == 1
    close = {"ar": [200.0] * 3, "depth 1": [280.0] * 3, "depth 2": [290.0] * 3, "depth 3": [285.0] * 3, "depth 4": [270.0] * 3}
    assert choose_depth(3, close) == 3  # within noise of the best: the cost model stands
    assert choose_depth(None, {"ar": [200.0] * 3, "depth 1": [205.0] * 3}) is None
    assert choose_depth(None, {"ar": [200.0] * 3, "depth 1": [260.0] * 3}) == 1
    assert choose_depth(2, {"ar": [300.0] * 3, "depth 1": [200.0] * 3, "depth 2": [250.0] * 3}) is None  # AR clearly faster
    # One noisy round does not overturn the model: depth 2 led by a lot once and lost the others.
    spike = {"ar": [570.0, 800.0, 790.0], "depth 2": [1400.0, 850.0, 840.0], "depth 3": [900.0, 900.0, 880.0]}
    assert choose_depth(3, spike) == 3
