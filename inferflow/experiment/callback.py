"""The Hydra callback that ends a measuring sweep with its summary table.

Registered in ``conf/config.yaml`` (``hydra.callbacks.summary``). Hydra creates it for every
run, so this module imports nothing heavy; it acts only at the end of a multirun
(``python -m inferflow -m ...``): when any run folder holds a ``results.json`` (a measuring
task: ``task=offline``, ``task=bench``) it writes ``summary.{csv,md,png}`` into the sweep folder
and prints the table. A sweep of other tasks (``task=check``) gets nothing. A failure to
summarize is one warning line; it never fails the sweep.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepSummary(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            from inferflow.experiment.summary import collect, write_summary

            sweep = Path(str(config.hydra.sweep.dir))
            rows = collect(sweep) if sweep.is_dir() else []
            if not any(not row.failed for row in rows):
                return  # no run measured anything
            files = write_summary(rows, sweep, title=f"sweep {sweep}")
        except Exception as exc:  # a summary never fails the sweep it summarizes
            print(f"inferflow: no sweep summary ({type(exc).__name__}: {exc})", file=sys.stderr)
            return
        written = ", ".join(str(p) for p in (files.csv, files.md, files.png) if p is not None)
        print(f"\n{files.text}\nsummary: {written}", flush=True)
