"""Repeated measurements: each figure's mean and spread, and the machine's load meanwhile.

A measured run repeats its workload ``experiment.repeats`` times; :func:`combine` turns the
repeats' figure dicts (one per repeat, vLLM's result keys) into one :class:`Spread` per figure.
The spread is the coefficient of variation (sample std / mean); a run whose headline figures
(:data:`HEADLINE`) vary by more than ``max_spread`` is marked too noisy to compare
(:func:`spread_verdict`). Each spread also carries a 95 % *prediction interval*: where one more
measurement of the same point is expected to fall (Student t with ``n - 1`` degrees of freedom,
``t * std * sqrt(1 + 1/n)``). With few repeats the sample std under-states the spread, and t is what
makes up for it: a repeat of the same point that falls outside this interval disagrees. :class:`MachineLoad` samples the whole machine's CPU use over the run,
so a reader can tell a slow point from a busy machine.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psutil

# The figures a summary shows and a spread verdict checks, in this order (vLLM's result keys;
# present in offline and served results alike, goodput only when SLOs were given).
HEADLINE = (
    "output_throughput",
    "request_goodput",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "p99_e2el_ms",
)
# Higher is better for these; lower for every latency (``*_ms``).
HIGHER_IS_BETTER = frozenset(
    {"output_throughput", "request_throughput", "total_token_throughput", "request_goodput"}
)


# Two-sided 95 % quantiles of Student's t, t(0.975, df) for df = 1..30 (beyond: the normal 1.96).
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def t975(df: int) -> float:
    """Student's t quantile for a two-sided 95 % interval with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError("Student's t needs at least one degree of freedom")
    return _T975[df - 1] if df <= len(_T975) else 1.96


@dataclass(frozen=True)
class Spread:
    """One figure over the repeats: ``cv`` = sample std / |mean| (0 with one repeat);
    ``pi95`` = half-width of the 95 % prediction interval for one more repeat (None with one
    repeat: a single value says nothing about its spread)."""

    mean: float
    std: float
    min: float
    max: float
    cv: float
    n: int
    values: tuple[float, ...]
    pi95: float | None = None

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one value")
        n = len(values)
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if n > 1 else 0.0
        cv = std / abs(mean) if mean else (0.0 if std == 0 else math.inf)
        pi95 = t975(n - 1) * std * math.sqrt(1 + 1 / n) if n > 1 else None
        return cls(mean, std, min(values), max(values), cv, n, tuple(values), pi95)

    def admits(self, value: float) -> bool:
        """Whether ``value`` (another measurement of the same point) lies in the 95 %
        prediction interval; always False with one repeat (no interval)."""
        return self.pi95 is not None and abs(value - self.mean) <= self.pi95

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "values": list(self.values)}


def combine(repeats: Sequence[Mapping[str, Any]]) -> dict[str, Spread]:
    """Per numeric figure present (not None) in every repeat, its spread over the repeats."""
    if not repeats:
        return {}
    keys = [k for k in repeats[0] if all(_number(r.get(k)) for r in repeats)]
    return {k: Spread.of([float(r[k]) for r in repeats]) for k in keys}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Verdict:
    """Whether a run's headline figures agree across repeats within ``max_spread``."""

    ok: bool
    max_spread: float
    wide: tuple[str, ...]  # the headline figures whose cv exceeds max_spread
    note: str | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "max_spread": self.max_spread,
            "wide": list(self.wide),
            "note": self.note,
        }


def spread_verdict(
    figures: Mapping[str, Spread], max_spread: float, headline: Iterable[str] = HEADLINE
) -> Verdict:
    wide = tuple(k for k in headline if k in figures and figures[k].cv > max_spread)
    if not wide:
        return Verdict(True, max_spread, (), None)
    parts = ", ".join(f"{k} varies {100 * figures[k].cv:.0f}%" for k in wide)
    note = (
        f"spread too wide to compare ({parts}; limit {100 * max_spread:.0f}%): "
        "rerun on an idle machine or raise experiment.repeats"
    )
    return Verdict(False, max_spread, wide, note)


class MachineLoad:
    """The machine's CPU use between :meth:`start` and :meth:`stop` (all cores, all processes:
    the measured server's own work included), and the 1-minute load average at the end.

    Use as a context manager; :meth:`to_dict` is what a result records under ``machine``."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self.busy_pct: float | None = None
        self.loadavg_1m: float | None = None

    def start(self) -> MachineLoad:
        self._before = psutil.cpu_times()
        return self

    def stop(self) -> None:
        after = psutil.cpu_times()
        total = sum(after) - sum(self._before)
        idle = (after.idle + getattr(after, "iowait", 0.0)) - (
            self._before.idle + getattr(self._before, "iowait", 0.0)
        )
        self.busy_pct = 100.0 * (1.0 - idle / total) if total > 0 else 0.0
        self.loadavg_1m = os.getloadavg()[0]

    def __enter__(self) -> MachineLoad:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "cpu_busy_pct": self.busy_pct, "loadavg_1m": self.loadavg_1m}

    @classmethod
    def mean(cls, loads: Sequence[MachineLoad]) -> MachineLoad:
        """Several measured stretches as one: their mean CPU use, the last load average."""
        if len(loads) == 1:
            return loads[0]
        merged = cls()
        busy = [m.busy_pct for m in loads if m.busy_pct is not None]
        merged.busy_pct = sum(busy) / len(busy) if busy else None
        merged.loadavg_1m = loads[-1].loadavg_1m if loads else None
        return merged


def cpu_busy_pct_now(seconds: float = 1.0) -> float:
    """The machine's CPU use over ``seconds`` before a measurement (what else is running)."""
    return float(psutil.cpu_percent(interval=seconds))
