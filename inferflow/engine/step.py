"""The engine step: schedule -> execute -> update (DESIGN.md §1). Everything else wraps it."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Protocol

from inferflow.scheduling.plan import ExecutorOutput, SchedulerOutput
from inferflow.scheduling.scheduler import Scheduler
from inferflow.scheduling.updates import StepUpdate

if TYPE_CHECKING:
    from inferflow.stages.guided import GuidedDecodingStage


class Executor(Protocol):
    """Runs one plan: ``kv_loads``, then one forward pass over ``chunks``, then sampling for the
    chunks with ``sample=True`` (a request in ``plan.token_bitmasks`` among its allowed tokens
    only), then ``kv_saves``. Drops per-request state (e.g. seeded RNGs) of
    ``plan.finished_request_ids``; a plan may consist of nothing else (no chunks)."""

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput: ...


def step(
    scheduler: Scheduler, executor: Executor, guided: GuidedDecodingStage | None = None
) -> list[StepUpdate]:
    """One engine step; a no-op (no executor call) when there is nothing to run or report.

    With ``guided`` (structured output), the constrained requests that sample in this step get
    their bitmask in the plan, and each sampled token advances its request's grammar; a grammar
    that is complete ends its request.
    """
    plan = scheduler.schedule()
    if guided is not None and plan.finished_request_ids:
        guided.finish(plan.finished_request_ids - plan.preempted_request_ids)
    if plan.is_empty and not plan.finished_request_ids:
        return []
    if guided is None:
        return scheduler.update(plan, executor.execute(plan))
    plan = _with_bitmasks(plan, guided)
    output = executor.execute(plan)
    _advance_grammars(plan, output, guided)
    updates = scheduler.update(plan, output)
    if plan.token_bitmasks:  # finished now: drop their matchers without waiting for a step
        guided.finish(u.request.request_id for u in updates if u.finish_reason is not None)
    return updates


def _with_bitmasks(plan: SchedulerOutput, guided: GuidedDecodingStage) -> SchedulerOutput:
    """``plan`` with a bitmask for each constrained request that samples in it (if any)."""
    constrained = [
        c.request_id for c in plan.chunks if c.sample and guided.constrains(c.request_id)
    ]
    if not constrained:
        return plan
    started = time.perf_counter()
    masks = guided.bitmasks(constrained)
    return dataclasses.replace(
        plan, token_bitmasks=masks, guided_mask_s=time.perf_counter() - started
    )


def _advance_grammars(
    plan: SchedulerOutput, output: ExecutorOutput, guided: GuidedDecodingStage
) -> None:
    """Feed each constrained request's sampled token to its grammar; mark completed ones."""
    for rid in plan.token_bitmasks:
        token = output.sampled.get(rid)
        if token is not None and guided.advance(rid, token.token_id):
            output.sampled[rid] = dataclasses.replace(token, grammar_complete=True)
