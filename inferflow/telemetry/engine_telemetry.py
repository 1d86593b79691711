"""The engine's one telemetry handle (worker process): request traces, engine-step spans and
Prometheus metrics, fed at the engine loop's boundaries so the loop itself stays ~10 lines::

    telemetry.on_request_arrived(rid, num_prompt_tokens=n, traceparent=tp, max_tokens=m)
    ...
    t0 = time.time()
    plan = scheduler.schedule(); out = executor.execute(plan); finished = scheduler.update(plan, out)
    telemetry.on_step(plan, out, start_time=t0, end_time=time.time(), scheduler=stats)
    for rid, reason in finished_now:
        timings = telemetry.on_request_finished(rid, reason)   # -> send timings.to_dict() back

Every public method is failure-isolated (logs, never raises). ``add_request`` may run on another
thread than ``step`` (LitServe), so the request table is locked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanContext
from opentelemetry.util.types import AttributeValue

from inferflow.scheduling.plan import ExecutorOutput, ScheduledChunk, SchedulerOutput
from inferflow.telemetry.isolation import isolated, log_telemetry_error
from inferflow.telemetry.metrics import EngineMetrics, FinishedRequestStats, StepStats
from inferflow.telemetry.request_trace import RequestTrace
from inferflow.telemetry.spans import record_step_span
from inferflow.telemetry.timings import RequestTimings


@dataclass(frozen=True)
class SchedulerStats:
    """Scheduler state after a step. Prefix-cache counters and preemptions are *for this step*
    (in tokens, like vLLM's ``prefix_cache_queries``/``hits``); blocks are the KV pool's."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0


@dataclass
class _Tracked:
    trace: RequestTrace
    max_tokens: int | None
    operation: str


def is_decode_row(chunk: ScheduledChunk) -> bool:
    """A decode row computes exactly one token of a request that already has output; anything
    else (prompt chunks, recompute after preemption) is prefill work."""
    return chunk.num_output_tokens > 0 and len(chunk.token_ids) == 1


@dataclass
class _StepTally:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_requests: int = 0
    num_decode_requests: int = 0


class EngineTelemetry:
    """Tracing (``tracer``) and metrics (``metrics``) of one engine; either may be None."""

    def __init__(
        self, tracer: trace.Tracer | None = None, metrics: EngineMetrics | None = None
    ) -> None:
        self.tracer = tracer
        self.metrics = metrics
        self._lock = threading.Lock()
        self._requests: dict[str, _Tracked] = {}

    @isolated(None)
    def on_request_arrived(
        self,
        request_id: str,
        *,
        num_prompt_tokens: int,
        traceparent: str | None = None,
        arrival_time: float | None = None,
        max_tokens: int | None = None,
        operation: str = "text_completion",
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        """The engine accepted a request (``add_request``); its queue time starts here.
        ``traceparent`` is the root span's context carried from the API process."""
        rt = RequestTrace(
            self.tracer,
            request_id,
            parent=traceparent,
            arrival_time=arrival_time,
            num_prompt_tokens=num_prompt_tokens,
            attributes=attributes,
        )
        with self._lock:
            self._requests[request_id] = _Tracked(rt, max_tokens, operation)

    def request_trace(self, request_id: str) -> RequestTrace | None:
        with self._lock:
            tracked = self._requests.get(request_id)
        return None if tracked is None else tracked.trace

    @contextmanager
    def stage(
        self, request_id: str, name: str, attributes: Mapping[str, AttributeValue] | None = None
    ) -> Iterator[None]:
        """Time a per-request stage in the engine (e.g. the detokenizer after each step);
        repeated runs coalesce into one span. The body's exceptions propagate unchanged."""
        start = time.time()
        try:
            yield
        finally:
            try:
                rt = self.request_trace(request_id)
                if rt is not None:
                    rt.record_stage(name, start, time.time(), attributes)
            except Exception as exc:
                log_telemetry_error(f"EngineTelemetry.stage({name})", exc)

    @isolated(None)
    def on_request_preempted(self, request_id: str) -> None:
        rt = self.request_trace(request_id)
        if rt is not None:
            rt.mark_preempted()

    @isolated(None)
    def on_step(
        self,
        plan: SchedulerOutput,
        output: ExecutorOutput,
        *,
        start_time: float,
        end_time: float,
        scheduler: SchedulerStats,
    ) -> None:
        """One engine step ran ``plan`` from ``start_time`` to ``end_time`` (tokens sampled at
        ``end_time``). Marks request timestamps, emits the ``engine step`` span, updates metrics."""
        tally, served, ttfts, gaps = _StepTally(), [], [], []
        with self._lock:
            for chunk in plan.chunks:
                decode = is_decode_row(chunk)
                if decode:
                    tally.num_decode_tokens += 1
                    tally.num_decode_requests += 1
                else:
                    tally.num_prefill_tokens += len(chunk.token_ids)
                    tally.num_prefill_requests += 1
                tracked = self._requests.get(chunk.request_id)
                if tracked is not None:
                    served.append(
                        self._mark_row(
                            tracked.trace, chunk, decode, output, start_time, end_time, ttfts, gaps
                        )
                    )
        if self.tracer is not None and plan.chunks:
            record_step_span(
                self.tracer,
                step_id=plan.step_id,
                start_time=start_time,
                end_time=end_time,
                served=served,
                batch_size=len(plan.chunks),
                **vars(tally),
            )
        if self.metrics is not None:
            self.metrics.on_step(
                StepStats(
                    batch_size=len(plan.chunks),
                    num_prefill_tokens=tally.num_prefill_tokens,
                    num_generation_tokens=len(output.sampled),
                    num_running=scheduler.num_running,
                    num_waiting=scheduler.num_waiting,
                    kv_blocks_used=scheduler.kv_blocks_used,
                    kv_blocks_total=scheduler.kv_blocks_total,
                    prefix_cache_queries=scheduler.prefix_cache_queries,
                    prefix_cache_hits=scheduler.prefix_cache_hits,
                    num_preemptions=scheduler.num_preemptions,
                    time_to_first_tokens=ttfts,
                    inter_token_latencies=gaps,
                )
            )

    @staticmethod
    def _mark_row(
        rt: RequestTrace,
        chunk: ScheduledChunk,
        decode: bool,
        output: ExecutorOutput,
        start_time: float,
        end_time: float,
        ttfts: list[float],
        gaps: list[float],
    ) -> tuple[str, SpanContext]:
        rt.mark_scheduled(start_time)
        rt.mark_step(prefill=not decode)
        if chunk.request_id in output.sampled:
            gap = rt.mark_token(end_time)
            if gap is None:
                ttfts.append(end_time - rt.arrival_time)
            else:
                gaps.append(gap)
        return chunk.request_id, rt.span_context

    @isolated(None)
    def on_request_finished(
        self,
        request_id: str,
        finish_reason: str,
        *,
        finish_time: float | None = None,
        num_cached_tokens: int | None = None,
        error: str | None = None,
    ) -> RequestTimings | None:
        """The request finished (stop | length | abort | error): emit its spans, record its
        metrics, forget it. Returns its timings (None for an unknown request id)."""
        with self._lock:
            tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return None
        rt = tracked.trace
        if num_cached_tokens is not None:
            rt.set_cached_tokens(num_cached_tokens)
        timings = rt.finish(finish_reason, finish_time, error=error)
        if self.metrics is not None:
            self.metrics.on_request_finished(
                FinishedRequestStats.from_timings(
                    timings,
                    finish_reason,
                    num_prompt_tokens=rt.num_prompt_tokens,
                    max_tokens=tracked.max_tokens,
                    operation=tracked.operation,
                )
            )
        return timings

    @property
    def num_tracked(self) -> int:
        with self._lock:
            return len(self._requests)
