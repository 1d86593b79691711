"""Telemetry wrapper for the executor stage (STYLE: one wrapper per stage, failures isolated).

The engine step stays ``plan = scheduler.schedule(); out = executor.execute(plan);
scheduler.update(plan, out)``: wrapping the executor is enough to time every step and see its
plan and sampled tokens, so nothing inside scheduling or the executor knows about telemetry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from inferflow.engine.step import Executor
from inferflow.scheduling.plan import ExecutorOutput, SchedulerOutput
from inferflow.telemetry.engine_telemetry import EngineTelemetry, SchedulerSnapshot
from inferflow.telemetry.isolation import log_telemetry_error


class TracedExecutor:
    """``execute`` = the inner executor's, timed and reported to ``telemetry.on_step``.

    ``snapshot`` returns the scheduler's stats (``lambda: scheduler.stats``); it is read after
    the forward pass, before ``scheduler.update``. While ``active()`` is False (e.g. the
    warm-up request) steps are run but not recorded. Other attributes pass through to ``inner``.
    """

    def __init__(
        self,
        inner: Executor,
        telemetry: EngineTelemetry,
        snapshot: Callable[[], SchedulerSnapshot] | None = None,
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.inner = inner
        self.telemetry = telemetry
        self._snapshot = snapshot
        self._active = active

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        if not self._active():
            return self.inner.execute(plan)
        start = time.time()
        output = self.inner.execute(plan)  # errors here are the engine's: they propagate
        end = time.time()
        try:
            stats = self._snapshot() if self._snapshot is not None else None
        except Exception as exc:
            log_telemetry_error("TracedExecutor.snapshot", exc)
            stats = None
        self.telemetry.on_step(plan, output, start_time=start, end_time=end, scheduler=stats)
        return output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
