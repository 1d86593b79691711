"""Repeated measurements: each figure's mean and spread, and the machine's load meanwhile.

A measured run repeats its workload ``experiment.repeats`` times; :func:`combine` turns the
repeats' figure dicts (one per repeat, vLLM's result keys) into one :class:`Spread` per figure.
The spread is the coefficient of variation (sample std / mean); a run whose headline figures
(:data:`HEADLINE`) vary by more than ``max_spread`` is marked too noisy to compare
(:func:`spread_verdict`). :class:`MachineLoad` samples the whole machine's CPU use over the run,
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


@dataclass(frozen=True)
class Spread:
    """One figure over the repeats: ``cv`` = sample std / |mean| (0 with one repeat)."""

    mean: float
    std: float
    min: float
    max: float
    cv: float
    n: int
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one value")
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        cv = std / abs(mean) if mean else (0.0 if std == 0 else math.inf)
        return cls(mean, std, min(values), max(values), cv, len(values), tuple(values))

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


def idle_cpu_pct(seconds: float = 1.0) -> float:
    """The machine's CPU use over ``seconds`` before a measurement (what else is running)."""
    return float(psutil.cpu_percent(interval=seconds))
