"""The engine step: schedule -> execute -> update (DESIGN.md §1). Everything else wraps it."""

from __future__ import annotations

from typing import Protocol

from inferflow.scheduling.plan import ExecutorOutput, SchedulerOutput
from inferflow.scheduling.scheduler import Scheduler
from inferflow.scheduling.updates import StepUpdate


class Executor(Protocol):
    """Runs one plan: ``kv_loads``, then one forward pass over ``chunks``, then sampling for the
    chunks with ``sample=True``, then ``kv_saves``. Drops per-request state (e.g. seeded RNGs) of
    ``plan.finished_request_ids``; a plan may consist of nothing else (no chunks)."""

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput: ...


def step(scheduler: Scheduler, executor: Executor) -> list[StepUpdate]:
    """One engine step; a no-op (no executor call) when there is nothing to run or report."""
    plan = scheduler.schedule()
    if plan.is_empty and not plan.finished_request_ids:
        return []
    output = executor.execute(plan)
    return scheduler.update(plan, output)
