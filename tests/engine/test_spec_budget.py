"""StepCostModel (decaying minimum per row count, interpolation, optimistic
extrapolation) and plan_drafts (expected tokens per second)."""

from __future__ import annotations

import pytest

from roseinfer.engine.spec_budget import StepCostModel, plan_drafts


def model(points: dict[int, float]) -> StepCostModel:
    cost = StepCostModel()
    for rows, seconds in points.items():
        cost.observe(rows, seconds)
    return cost


def test_estimate_nothing_measured() -> None:
    assert StepCostModel().estimate(4) is None


def test_decaying_minimum() -> None:
    cost = model({1: 0.020})
    cost.observe(1, 0.050)  # a slow outlier (other load): hardly moves it
    assert cost.estimate(1) == pytest.approx(0.0204)
    cost.observe(1, 0.010)
    assert cost.estimate(1) == 0.010


def test_interpolation_and_extrapolation() -> None:
    cost = model({2: 0.020, 6: 0.040})
    assert cost.estimate(4) == pytest.approx(0.030)
    assert cost.estimate(1) == pytest.approx(0.010)
    assert 0.040 < cost.estimate(10) < 0.040 * 10 / 6  # optimistic above the largest


def test_plan_takes_drafts_worth_their_rows() -> None:
    # Batch 1 on int8 weights: 2 rows cost 1.6x one, more rows ~0.2x each.
    cost = model({1: 10.0, 2: 16.0, 3: 18.0, 4: 20.0, 5: 22.0, 6: 24.0, 7: 26.0})
    assert plan_drafts(cost, 1, 1, [[0.5]], 64) == [0]  # 1.5 / 16 < 1 / 10
    assert plan_drafts(cost, 1, 1, [[0.9 ** i for i in range(1, 7)]], 64) == [6]
    assert plan_drafts(cost, 1, 1, [[0.9 ** i for i in range(1, 7)]], 4) == [3]  # budget


def test_plan_compute_bound_batch_keeps_only_likely_drafts() -> None:
    # 16 rows cost 80, each extra row 4: a draft must be accepted with chance > 0.8.
    cost = model({16: 80.0, 48: 208.0})
    chances = [[0.95, 0.9025]] * 4 + [[0.5, 0.25]] * 12
    counts = plan_drafts(cost, 16, 16, chances, 256)
    assert counts == [2] * 4 + [0] * 12


def test_plan_without_measurements_feeds_everything() -> None:
    assert plan_drafts(StepCostModel(), 2, 2, [[0.1, 0.01], [0.5]], 64) == [2, 1]
