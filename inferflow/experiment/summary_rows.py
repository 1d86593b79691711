"""A sweep's measured points as rows (:class:`SummaryRow`, each figure a :class:`Figure`): read
from a sweep folder's run folders (:func:`collect`: each run's ``results.json`` and the
overrides Hydra recorded for it) or made from a tuner's results (:meth:`SummaryRow.from_result`).
:mod:`~inferflow.experiment.summary` lays them out as the sweep's table and plot."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from inferflow.experiment.results import RESULTS_NAME, read_result

# Keys of results files before issue 42 -> today's names.
LEGACY = {
    "output_throughput_tok_s": "output_throughput",
    "request_throughput_req_s": "request_throughput",
}


@dataclass(frozen=True)
class Figure:
    """One figure of a row: ``std``/``cv``/``pi95`` are None where the result recorded no
    spread (``pi95``: half-width of the 95 % prediction interval for one more repeat)."""

    mean: float
    std: float | None = None
    cv: float | None = None
    pi95: float | None = None

    @property
    def half_width(self) -> float | None:
        """What the table writes after ``±`` and the plot draws as error bars: the 95 %
        prediction interval where the result has one, else the std (older results); None for
        a single repeat (its std of 0 says nothing)."""
        return self.pi95 if self.pi95 is not None else (self.std or None)


@dataclass(frozen=True)
class SummaryRow:
    """One measured point. ``failed``: no results (the run failed, was interrupted, or the
    tuner found it infeasible); ``note`` says why, or what the spread verdict said."""

    label: str
    params: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Figure] = field(default_factory=dict)
    cpu_busy_pct: float | None = None
    spread_ok: bool | None = None  # None: not recorded (old results) or failed
    note: str | None = None
    failed: bool = False
    repeats: int | None = None

    @property
    def status(self) -> str:
        if self.failed:
            return "failed"
        return {True: "ok", False: "noisy", None: "?"}[self.spread_ok]

    @classmethod
    def from_result(
        cls,
        params: Mapping[str, object],
        result: Mapping[str, Any] | None,
        label: str = "",
        error: str | None = None,
    ) -> SummaryRow:
        """A row from a point's parameters and its ``results.json`` dict (None: failed)."""
        values = {str(k): _text(v) for k, v in params.items()}
        if result is None:
            return cls(label, values, note=error or "no results", failed=True)
        if isinstance(result.get("failed"), str):  # a point that did not run (served.py, cli)
            return cls(label, values, note=error or result["failed"], failed=True)
        spread, machine = _mapping(result.get("spread")), _mapping(result.get("machine"))
        notes = [n for n in (spread.get("note"), error) if n]
        ok = spread.get("ok")
        return cls(
            label,
            values,
            _figures(result),
            cpu_busy_pct=number_or_none(machine.get("cpu_busy_pct")),
            spread_ok=ok if isinstance(ok, bool) else None,
            note="; ".join(notes) or None,
            repeats=result.get("repeats") if isinstance(result.get("repeats"), int) else None,
        )

    @classmethod
    def from_overrides(
        cls,
        overrides: Sequence[str],
        result: Mapping[str, Any] | None,
        label: str = "",
        error: str | None = None,
    ) -> SummaryRow:
        """A row from Hydra overrides (``["batching.max_num_seqs=8", ...]``) and a result."""
        return cls.from_result(parse_overrides(overrides), result, label, error)


def parse_overrides(overrides: Sequence[str]) -> dict[str, str]:
    """``key=value`` overrides as a dict (``+key``/``++key`` as ``key``; ``~key`` -> ``~``)."""
    params: dict[str, str] = {}
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if key.startswith("~"):
            key, value = key[1:], "~"
        elif not sep:
            continue
        params[key.lstrip("+")] = value
    return params


def _figures(result: Mapping[str, Any]) -> dict[str, Figure]:
    figures: dict[str, Figure] = {}
    spreads = result.get("figures")
    if isinstance(spreads, Mapping):
        for name, spread in spreads.items():
            if isinstance(spread, Mapping) and number_or_none(spread.get("mean")) is not None:
                mean = float(spread["mean"])
                figures[name] = Figure(
                    mean,
                    number_or_none(spread.get("std")),
                    number_or_none(spread.get("cv")),
                    number_or_none(spread.get("pi95")),
                )
    for key, value in result.items():  # the flat means (and old results' only figures)
        name = LEGACY.get(key, key)
        if name not in figures and number_or_none(value) is not None:
            figures[name] = Figure(float(value))
    return figures


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def number_or_none(value: object) -> float | None:
    """A finite number as float; None for anything else (bool, NaN, text, missing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# --- reading a sweep folder -------------------------------------------------------------------


def collect(sweep_dir: Path) -> list[SummaryRow]:
    """One row per run folder of a Hydra multirun dir (a folder with ``results.json`` or
    ``.hydra/``), in job order; a run without results is a failed row."""
    runs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and _is_run(p)]
    return [_row(run) for run in sorted(runs, key=_job_order)]


def _is_run(path: Path) -> bool:
    return (path / RESULTS_NAME).is_file() or (path / ".hydra").is_dir()


def _job_order(path: Path) -> tuple[int, str]:
    head = path.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else sys.maxsize, path.name)


def _row(run: Path) -> SummaryRow:
    label = run.name.split("_", 1)[0] if run.name.split("_", 1)[0].isdigit() else run.name
    overrides = _hydra_overrides(run)
    path = run / RESULTS_NAME
    if not path.is_file():
        error = f"no {RESULTS_NAME}: the run failed or was interrupted"
        return SummaryRow.from_overrides(overrides, None, label, error)
    try:
        result = read_result(path)
    except (OSError, ValueError) as exc:
        return SummaryRow.from_overrides(
            overrides, None, label, f"unreadable {RESULTS_NAME}: {exc}"
        )
    recorded = result.get("overrides")
    if isinstance(recorded, list):
        overrides = [str(o) for o in recorded]
    return SummaryRow.from_overrides(overrides, result, label)


def _hydra_overrides(run: Path) -> list[str]:
    path = run / ".hydra" / "overrides.yaml"
    try:
        data = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


# --- the table --------------------------------------------------------------------------------
