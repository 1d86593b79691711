"""The engine's one telemetry handle (worker process): request traces, engine-step spans and
Prometheus metrics, fed at the engine's boundaries so the step itself stays three calls::

    telemetry = EngineTelemetry(tracer, EngineMetrics(model_name, engine_index=worker_id))
    executor = TracedExecutor(executor, telemetry, snapshot=lambda: scheduler.stats)  # per step
    telemetry.on_request_arrived(rid, num_prompt_tokens=n, trace_context=carrier, ...)  # add_request
    with telemetry.stage(rid, "detokenizer"): ...                                    # per delta
    telemetry.on_request_finished(rid, finish_reason, metrics=request.metrics)       # once

Every public method is failure-isolated (logs, never raises). ``add_request`` may run on another
thread than ``step`` (LitServe), so the request table is locked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanContext
from opentelemetry.util.types import AttributeValue

from inferflow.outputs import RequestMetrics
from inferflow.scheduling.plan import ExecutorOutput, ScheduledChunk, SchedulerOutput
from inferflow.scheduling.updates import SpecDecodeStats
from inferflow.telemetry import attributes as A
from inferflow.telemetry.isolation import isolated, log_telemetry_error
from inferflow.telemetry.metrics import EngineMetrics, FinishedRequestStats, StepStats
from inferflow.telemetry.request_trace import RequestTrace
from inferflow.telemetry.spans import ParentLike, record_step_span
from inferflow.telemetry.spec_decode import span_attributes, step_spec_decode
from inferflow.telemetry.timings import RequestTimings


class SchedulerSnapshot(Protocol):
    """Scheduler state as ``inferflow.scheduling.updates.SchedulerStats`` has it. The prefix-cache
    counters (tokens) and preemptions are cumulative; telemetry takes per-step differences."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_kv_blocks_total(self) -> int: ...
    @property
    def num_kv_blocks_used(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...


@dataclass
class _Tracked:
    trace: RequestTrace
    max_tokens: int | None
    operation: str


@dataclass
class _StepTally:
    """One step's rows: tokens and requests by kind, traced rows, first tokens and gaps."""

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_requests: int = 0
    num_decode_requests: int = 0
    served: list[tuple[str, SpanContext]] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


def is_decode_row(chunk: ScheduledChunk) -> bool:
    """A decode row computes exactly one token of a request that already has output (plus its
    drafts, with speculative decoding); anything else (prompt chunks, recompute after
    preemption) is prefill work."""
    return chunk.num_output_tokens > 0 and len(chunk.token_ids) - len(chunk.draft_token_ids) == 1


class EngineTelemetry:
    """Tracing (``tracer``) and metrics (``metrics``) of one engine; either may be None."""

    def __init__(
        self, tracer: trace.Tracer | None = None, metrics: EngineMetrics | None = None
    ) -> None:
        self.tracer = tracer
        self.metrics = metrics
        self._lock = threading.Lock()
        self._requests: dict[str, _Tracked] = {}
        self._counters = (0, 0, 0)  # last cumulative (prefix queries, prefix hits, preemptions)

    @isolated(None)
    def on_request_arrived(
        self,
        request_id: str,
        *,
        num_prompt_tokens: int,
        trace_context: ParentLike = None,
        arrival_time: float | None = None,
        max_tokens: int | None = None,
        operation: str = "text_completion",
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        """The engine accepted a request (``add_request``); its queue time starts here.
        ``trace_context``: the root span's traceparent string or W3C carrier dict."""
        rt = RequestTrace(
            self.tracer,
            request_id,
            parent=trace_context,
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
    def on_step(
        self,
        plan: SchedulerOutput,
        output: ExecutorOutput,
        *,
        start_time: float,
        end_time: float,
        scheduler: SchedulerSnapshot | None = None,
    ) -> None:
        """One engine step ran ``plan`` from ``start_time`` to ``end_time`` (tokens sampled at
        ``end_time``). Marks request timestamps, emits the ``engine step`` span, updates metrics."""
        with self._lock:
            tally = self._tally(plan, output, start_time, end_time)
        spec = step_spec_decode(plan, output)
        # a step span only when it served a traced (sampled) request: no orphan step traces
        if self.tracer is not None and any(sc.trace_flags.sampled for _, sc in tally.served):
            record_step_span(
                self.tracer,
                step_id=plan.step_id,
                start_time=start_time,
                end_time=end_time,
                served=tally.served,
                batch_size=len(plan.chunks),
                num_prefill_tokens=tally.num_prefill_tokens,
                num_decode_tokens=tally.num_decode_tokens,
                num_prefill_requests=tally.num_prefill_requests,
                num_decode_requests=tally.num_decode_requests,
                attributes={**_guided_step_attributes(plan), **span_attributes(spec)},
            )
        if self.metrics is not None:
            self.metrics.on_step(self._step_stats(plan, output, tally, scheduler, spec))

    def _tally(
        self, plan: SchedulerOutput, output: ExecutorOutput, start: float, end: float
    ) -> _StepTally:
        tally = _StepTally()
        for chunk in plan.chunks:
            decode = is_decode_row(chunk)
            if decode:
                tally.num_decode_tokens += len(chunk.token_ids)
                tally.num_decode_requests += 1
            else:
                tally.num_prefill_tokens += len(chunk.token_ids)
                tally.num_prefill_requests += 1
            tracked = self._requests.get(chunk.request_id)
            if tracked is None:
                continue  # not registered with on_request_arrived: counted, not traced
            rt = tracked.trace
            rt.mark_scheduled(start)
            rt.mark_step(prefill=not decode)
            tally.served.append((chunk.request_id, rt.span_context))
            if chunk.request_id in output.sampled:
                gap = rt.mark_token(end, len(output.new_tokens(chunk.request_id)))
                if gap is None:
                    tally.ttfts.append(end - rt.arrival_time)
                else:
                    tally.gaps.append(gap)
        return tally

    def _step_stats(
        self,
        plan: SchedulerOutput,
        output: ExecutorOutput,
        tally: _StepTally,
        scheduler: SchedulerSnapshot | None,
        spec: SpecDecodeStats,
    ) -> StepStats:
        queries = hits = preemptions = 0
        if scheduler is not None:
            now = (
                scheduler.prefix_cache_queries,
                scheduler.prefix_cache_hits,
                scheduler.num_preemptions,
            )
            with self._lock:
                # a counter that went down belongs to a new scheduler: count it from zero
                queries, hits, preemptions = (
                    n - p if n >= p else n for n, p in zip(now, self._counters, strict=True)
                )
                self._counters = now
        return StepStats(
            batch_size=len(plan.chunks),
            num_prefill_tokens=tally.num_prefill_tokens,
            num_generation_tokens=len(output.sampled) + spec.num_accepted_tokens,
            num_running=scheduler.num_running if scheduler is not None else len(plan.chunks),
            num_waiting=scheduler.num_waiting if scheduler is not None else 0,
            kv_blocks_used=scheduler.num_kv_blocks_used if scheduler is not None else 0,
            kv_blocks_total=scheduler.num_kv_blocks_total if scheduler is not None else 0,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
            time_to_first_tokens=tally.ttfts,
            inter_token_latencies=tally.gaps,
            guided_rows=len(plan.token_bitmasks),
            guided_mask_s=plan.guided_mask_s,
            spec_decode=spec,
        )

    @isolated(None)
    def on_request_finished(
        self,
        request_id: str,
        finish_reason: str,
        *,
        finish_time: float | None = None,
        metrics: RequestMetrics | None = None,
        num_cached_tokens: int | None = None,
        num_output_tokens: int | None = None,
        error: str | None = None,
    ) -> RequestTimings | None:
        """The request finished (stop | length | abort | error): emit its spans, record its
        metrics, forget it. ``metrics``: the engine's own timestamps, which then win over the
        ones marked from steps (so spans, headers and RequestOutput.metrics agree; pass the same
        ``arrival_time`` to ``add_request`` and ``on_request_arrived``). Returns the request's
        timings (None for an unknown request id)."""
        with self._lock:
            tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return None
        rt = tracked.trace
        if metrics is not None:
            rt.update_from_metrics(metrics)
            finish_time = finish_time if finish_time is not None else metrics.finished_time
        if num_cached_tokens is not None:
            rt.num_cached_tokens = num_cached_tokens
        if num_output_tokens is not None:  # the engine's count wins over tokens seen in steps
            rt.num_output_tokens = num_output_tokens
        timings = rt.finish(finish_reason, finish_time, error=error)
        if self.metrics is not None:
            self.metrics.on_request_finished(
                FinishedRequestStats(
                    timings,
                    finish_reason,
                    num_prompt_tokens=rt.num_prompt_tokens,
                    max_tokens=tracked.max_tokens,
                    operation=tracked.operation,
                    guided_compile_s=metrics.guided_compile_s if metrics is not None else None,
                    guided_cache_hit=metrics.guided_cache_hit if metrics is not None else None,
                )
            )
        return timings

    @property
    def num_tracked(self) -> int:
        with self._lock:
            return len(self._requests)


def _guided_step_attributes(plan: SchedulerOutput) -> dict[str, AttributeValue]:
    """Structured-output rows of a step and the time their masks took (empty without any)."""
    if not plan.token_bitmasks:
        return {}
    return {
        A.STEP_GUIDED_ROWS: len(plan.token_bitmasks),
        A.STEP_GUIDED_MASK_MS: round(plan.guided_mask_s * 1000, 4),
    }
