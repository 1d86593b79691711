"""One example per slot kind, each the smallest real implementation of its contract.

- ``batching=shortest_first``: continuous batching that admits the shortest waiting prompt first
  (and, under memory pressure, preempts the longest first): a scheduling policy, nothing else.
- ``executor=step_counter``: the built-in ONNX Runtime executor, wrapped to count the steps and
  rows it runs (shown under ``engine.executor`` in ``/admin/stats``).
- ``+stages=shout``: a response stage that upper-cases the generated text, streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from inferflow.scheduling.plan import ExecutorOutput, SchedulerOutput
from inferflow.scheduling.policy import RequestQueue, SortedQueue, SortKey
from inferflow.scheduling.request import Request
from inferflow.stages.batching import ContinuousBatching
from inferflow.stages.executor import OnnxRuntimeExecutor
from inferflow.stages.response import ResponseDelta, ResponseStage


@dataclass
class ShortestPromptFirst(ContinuousBatching):
    """Admit waiting requests shortest prompt first (ties: arrival order)."""

    def sort_key(self, request: Request, seq: int) -> SortKey:
        return (request.num_prompt_tokens, seq)

    def make_queue(self, keys: dict[str, SortKey]) -> RequestQueue:
        return SortedQueue(keys)


@dataclass
class StepCountingExecutor(OnnxRuntimeExecutor):
    """ONNX Runtime on CPU, counting the engine steps and rows it executes."""

    backend: ClassVar[str] = "step_counter"
    steps: int = field(default=0, init=False)
    rows: int = field(default=0, init=False)

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        self.steps += 1
        self.rows += len(plan.chunks)
        return super().execute(plan)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "wraps": OnnxRuntimeExecutor.backend}

    def stats(self) -> dict[str, float]:
        return {"steps": self.steps, "rows": self.rows}


@dataclass
class ShoutingResponse(ResponseStage):
    """Upper-case the generated text (character by character, so any split gives the same)."""

    def process(self, delta: ResponseDelta, state: Any) -> ResponseDelta:
        return delta.with_text(delta.text.upper())
