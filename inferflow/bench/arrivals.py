"""When each request of a run is released, as offsets (seconds) from the start of the run.

``rate = inf`` releases every request at 0. Otherwise inter-arrival gaps are gamma distributed
with shape ``burstiness`` and scale ``1 / (rate · burstiness)`` (mean gap ``1/rate``):
burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular, ``inf`` evenly spaced.
As in vLLM, the cumulative offsets are rescaled so the last request is released at exactly
``n / rate``, so runs with different seeds offer the same average load.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """``n`` non-decreasing release offsets; the first is the first gap (vLLM's convention)."""
    if n < 1:
        raise ValueError(f"need at least one request, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    offsets = np.cumsum(gaps)
    if offsets[-1] > 0:
        offsets *= (n / rate) / offsets[-1]
    return [float(x) for x in offsets]
