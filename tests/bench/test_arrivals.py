"""Arrival schedules: all at once, Poisson/gamma at a rate, evenly spaced."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferflow.bench.arrivals import arrival_offsets


def test_infinite_rate_releases_everything_at_once() -> None:
    assert arrival_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5


@pytest.mark.parametrize("burstiness", [0.3, 1.0, 4.0])
def test_last_release_is_rescaled_to_n_over_rate(burstiness: float) -> None:
    offsets = arrival_offsets(50, 10.0, burstiness, seed=1)
    assert offsets[-1] == pytest.approx(5.0)
    assert offsets == sorted(offsets) and offsets[0] > 0


def test_infinite_burstiness_is_evenly_spaced() -> None:
    assert arrival_offsets(4, 2.0, math.inf, seed=0) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_lower_burstiness_gives_more_variable_gaps() -> None:
    def cv(b: float) -> float:
        gaps = np.diff([0.0, *arrival_offsets(4000, 100.0, b, seed=2)])
        return float(np.std(gaps) / np.mean(gaps))

    # Gamma(k) gaps have coefficient of variation 1/sqrt(k): Poisson ~1, bursty > 1, regular < 1.
    assert cv(0.25) == pytest.approx(2.0, rel=0.15)
    assert cv(1.0) == pytest.approx(1.0, rel=0.1)
    assert cv(4.0) == pytest.approx(0.5, rel=0.1)


def test_seeded_and_reproducible() -> None:
    assert arrival_offsets(10, 5.0, 1.0, seed=3) == arrival_offsets(10, 5.0, 1.0, seed=3)
    assert arrival_offsets(10, 5.0, 1.0, seed=3) != arrival_offsets(10, 5.0, 1.0, seed=4)


@pytest.mark.parametrize(("n", "rate", "burst"), [(0, 1.0, 1.0), (3, 0.0, 1.0), (3, 1.0, 0.0)])
def test_invalid_arguments(n: int, rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        arrival_offsets(n, rate, burst, seed=0)
