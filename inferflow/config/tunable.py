"""Knobs ``inferflow tune`` may turn: declared on the config schema, beside the field they tune.

A stage's dataclass field is tunable when its metadata holds a :class:`Tunable` (use
:func:`tunable` to declare the field)::

    max_num_seqs: int = tunable(64, low=1, high=256, log=True)
    precision: Precision = tunable(Precision.fp32, choices=("fp32", "int8", "int4"))

The tuner (``inferflow/experiment/space.py``) reads these from the class each slot's
``_target_`` names, so a knob exists exactly when the option that has it is selected (the draft
length only with ``speculative=ngram``): the search space is conditional, define-by-run. Which
options of a slot group the tuner may choose between is ``TUNABLE_OPTIONS`` in
``stages/registry.py``. A point that composes but that the graph refuses (``task=check``'s rules:
budgets against the layout, an executor setting this machine cannot run) is infeasible; it is
never measured.

Leaf module: imports nothing of inferflow.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TUNE_KEY = "tune"  # the field metadata key


@dataclass(frozen=True)
class Tunable:
    """A knob's range: integers ``low..high`` (``log``: sampled on a log scale; ``high=None``:
    this machine's CPU count), or ``choices`` (config values, as strings or numbers).
    ``simulated``: the tuner's engine model (the scheduler replayed on measured step times)
    sees its effect; knobs it cannot model (API processes) are decided by real runs only.
    ``note``: why the knob matters, for ``inferflow tune --list``."""

    low: int | None = None
    high: int | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()
    simulated: bool = True
    note: str = ""

    def __post_init__(self) -> None:
        if bool(self.choices) == (self.low is not None):
            raise ValueError("Tunable: give either low (and high) or choices")
        if self.low is not None and self.high is not None and self.high < self.low:
            raise ValueError(f"Tunable: high {self.high} < low {self.low}")

    @property
    def upper(self) -> int:
        """``high``, or this machine's CPU count when it is None."""
        return self.high if self.high is not None else max(1, os.cpu_count() or 1)

    def describe(self) -> str:
        if self.choices:
            return ",".join(str(c) for c in self.choices)
        return f"{self.low}:{self.upper}" + (":log" if self.log else "")


def tunable(
    default: Any,
    *,
    low: int | None = None,
    high: int | None = None,
    log: bool = False,
    choices: Sequence[Any] = (),
    simulated: bool = True,
    note: str = "",
) -> Any:
    """A dataclass field with ``default`` whose metadata declares it tunable (see the module doc)."""
    spec = Tunable(low, high, log, tuple(choices), simulated, note)
    return dataclasses.field(default=default, metadata={TUNE_KEY: spec})


def tunables(cls: type) -> dict[str, Tunable]:
    """The tunable init fields of a dataclass ``cls`` (name -> range), in field order."""
    if not dataclasses.is_dataclass(cls):
        return {}
    return {
        f.name: f.metadata[TUNE_KEY]
        for f in dataclasses.fields(cls)
        if f.init and TUNE_KEY in f.metadata
    }
