"""One measured run's ``results.json``: the same layout for ``task=offline`` and ``task=bench``.

::

    {"task": "bench", "overrides": ["batching.max_num_seqs=8"],   # the sweep's point
     "repeats": 3, "warmup": 1,
     "figures": {"output_throughput": {"mean", "std", "min", "max", "cv", "n", "values"}, ...},
     "spread": {"ok": true, "max_spread": 0.1, "wide": [], "note": null},
     "machine": {"cores": 2, "cpu_busy_pct": 97.1, "loadavg_1m": 1.9, "cpu_busy_before_pct": 0.5},
     "per_repeat": [{vLLM result keys of repeat 1}, ...],
     "output_throughput": 512.3, "p99_ttft_ms": 801.2, ...}        # each figure's mean, flat

The flat means are what ``jq .output_throughput`` reads; ``figures`` has the spread. Figure names
are vLLM's ``bench serve`` result keys (:mod:`inferflow.bench.metrics`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from inferflow.experiment.figures import MachineLoad, combine, spread_verdict

RESULTS_NAME = "results.json"


def measured_result(
    task: str,
    repeats: Sequence[Mapping[str, Any]],
    *,
    warmup: int,
    max_spread: float,
    machine: MachineLoad,
    cpu_busy_before_pct: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The record of one measured point from its repeats' figure dicts (see the module doc)."""
    figures = combine(repeats)
    verdict = spread_verdict(figures, max_spread)
    result: dict[str, Any] = {
        "task": task,
        "repeats": len(repeats),
        "warmup": warmup,
        **(extra or {}),
        "figures": {k: v.to_dict() for k, v in figures.items()},
        "spread": verdict.to_dict(),
        "machine": {**machine.to_dict(), "cpu_busy_before_pct": cpu_busy_before_pct},
        "per_repeat": [dict(r) for r in repeats],
    }
    for key, spread in figures.items():
        result.setdefault(key, spread.mean)
    return result


def write_result(result: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def read_result(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a results object")
    return data
