"""One point of ``inferflow tune``'s search (:class:`Trial`): its knobs, what the engine model
predicted and what the served runs measured at each stage (``short``, ``confirm``); and
whether a measurement lies inside another's prediction interval (:func:`within_interval`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from inferflow.experiment.space import Point


@dataclass
class Trial:
    """One point: its knobs, what the model predicted, what the served runs measured."""

    number: int
    point: Point
    overrides: list[str]
    label: str = ""
    state: str = "ok"  # ok | infeasible | failed | skipped
    reason: str = ""
    predicted: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage -> results
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> wall time

    def goodput(self, stage: str) -> float | None:
        result = self.measured.get(stage)
        if not result or result.get("failed"):
            return None
        value = result.get("request_goodput")
        return float(value) if value is not None else None


def goodput_interval(trial: Trial, stage: str | None) -> tuple[float, float] | None:
    """(mean, half-width) of the 95 % prediction interval of ``trial``'s goodput at ``stage``;
    None without one (a single repeat, or nothing measured)."""
    if not stage:
        return None
    spread = trial.measured.get(stage, {}).get("figures", {}).get("request_goodput") or {}
    mean, half = spread.get("mean"), spread.get("pi95")
    return None if mean is None or half is None else (float(mean), float(half))


def within_interval(winner: Trial, result: Mapping[str, Any], stage: str | None) -> bool:
    """Whether ``result``'s goodput lies in the 95 % prediction interval of ``winner``'s
    measurement at ``stage`` (False when the winner has no interval: a single repeat)."""
    interval = goodput_interval(winner, stage)
    if interval is None or "request_goodput" not in result:
        return False
    return abs(float(result["request_goodput"]) - interval[0]) <= interval[1]
