"""Repeats' spread: the 95 % prediction interval a repeat of the same point must fall in."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from inferflow.experiment.figures import Spread, combine, t975


def test_t_quantiles_match_known_values() -> None:
    assert t975(1) == pytest.approx(12.706, abs=1e-3)
    assert t975(2) == pytest.approx(4.303, abs=1e-3)
    assert t975(10) == pytest.approx(2.228, abs=1e-3)
    assert t975(1000) == 1.96
    with pytest.raises(ValueError):
        t975(0)


def test_prediction_interval_of_three_repeats() -> None:
    spread = Spread.of([3.0, 3.2, 3.1])
    std = statistics.stdev([3.0, 3.2, 3.1])
    assert spread.n == 3 and spread.std == pytest.approx(std)
    assert spread.pi95 == pytest.approx(4.303 * std * math.sqrt(1 + 1 / 3))
    assert spread.admits(3.1 + 0.99 * spread.pi95)
    assert not spread.admits(3.1 + 1.01 * spread.pi95)


def test_one_repeat_has_no_interval() -> None:
    spread = Spread.of([5.0])
    assert spread.pi95 is None and spread.std == 0.0
    assert not spread.admits(5.0)  # one value says nothing about where the next falls


def test_interval_covers_about_95_percent_of_new_draws() -> None:
    """Coverage on seeded normal draws: the interval is calibrated (the std alone, with three
    repeats, would cover far fewer)."""
    rng = random.Random(0)
    hits = std_hits = 0
    trials = 4000
    for _ in range(trials):
        spread = Spread.of([rng.gauss(10.0, 1.0) for _ in range(3)])
        new = rng.gauss(10.0, 1.0)
        hits += spread.admits(new)
        std_hits += abs(new - spread.mean) <= spread.std
    assert 0.93 < hits / trials < 0.97
    assert std_hits / trials < 0.75


def test_combine_records_the_interval() -> None:
    figures = combine(
        [{"request_goodput": 1.0}, {"request_goodput": 1.2}, {"request_goodput": 1.1}]
    )
    record = figures["request_goodput"].to_dict()
    assert record["pi95"] == pytest.approx(figures["request_goodput"].pi95)
    assert record["n"] == 3
