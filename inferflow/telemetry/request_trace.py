"""Per-request trace recorder for the worker process (the engine side of a request).

The engine marks timestamps as they happen (``mark_scheduled``, ``mark_token``, ...) and calls
``finish``; the recorder then emits, with explicit start/end times, the spans of the layout in
:mod:`inferflow.telemetry.attributes`: ``queue`` and ``compute`` (``prefill``, ``decode``) under the
live ``llm_request`` span, and one span per recorded stage under the request's root span.
A RequestTrace is owned by one thread at a time (the engine loop); it is not locked.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, SpanContext, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from inferflow.outputs import RequestMetrics
from inferflow.telemetry import attributes as A
from inferflow.telemetry.isolation import isolated
from inferflow.telemetry.spans import ParentLike, emit_span, parent_context, start_span, to_ns
from inferflow.telemetry.timings import RequestTimings

STAGE_DETOKENIZER = "detokenizer"  # the engine-side stage span recorded per request
STAGE_GUIDED = "guided"  # structured output: compiling (or fetching) the request's grammar


@dataclass
class _StageRecord:
    """A stage that may run many times for one request (e.g. incremental detokenization) is
    coalesced into one span from its first start to its last end; ``busy`` sums the run times."""

    start: float
    end: float
    calls: int = 1
    busy: float = 0.0
    attributes: dict[str, AttributeValue] = field(default_factory=dict)


class RequestTrace:
    """Timestamps of one request in the engine, and the spans they become at ``finish``.

    ``parent`` is the request's root span context as carried from the API process (a traceparent
    string or W3C carrier dict); without one (offline ``LLM.generate``) ``llm_request`` is the
    trace's root.
    ``tracer=None`` records timestamps only (timings and metrics still work, no spans).
    """

    def __init__(
        self,
        tracer: trace.Tracer | None,
        request_id: str,
        *,
        parent: ParentLike = None,
        arrival_time: float | None = None,
        num_prompt_tokens: int = 0,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        self.tracer = tracer
        self.request_id = request_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.prefill_end_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.finish_reason: str | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.num_prefill_steps = 0
        self.num_decode_steps = 0
        self.num_preemptions = 0
        self._stages: dict[str, _StageRecord] = {}
        self._root = parent_context(parent)
        has_root = trace.get_current_span(self._root).get_span_context().is_valid
        attrs = {A.REQUEST_ID: request_id, A.GEN_AI_REQUEST_ID: request_id, **(attributes or {})}
        self._span = (
            INVALID_SPAN
            if tracer is None
            else start_span(
                tracer,
                A.SPAN_LLM_REQUEST,
                self._root,
                attrs,
                trace.SpanKind.INTERNAL,
                self.arrival_time,
            )
        )
        # stages hang under the request's root span; offline (no root) under llm_request itself
        self._stage_parent = self._root if has_root else self._span

    @property
    def span_context(self) -> SpanContext:
        """Context of the live ``llm_request`` span: engine-step spans link to it."""
        return self._span.get_span_context()

    @property
    def finished(self) -> bool:
        return self.finished_time is not None

    # --- timestamps, as the engine sees them ----------------------------------------------------
    def mark_scheduled(self, t: float) -> None:
        """The request is in a step's batch; the first call ends its queue time."""
        if self.first_scheduled_time is None:
            self.first_scheduled_time = max(t, self.arrival_time)

    def mark_step(self, *, prefill: bool) -> None:
        """Count one engine step this request took part in (prefill chunk or decode row)."""
        if prefill:
            self.num_prefill_steps += 1
        else:
            self.num_decode_steps += 1

    def mark_token(self, t: float, n: int = 1) -> float | None:
        """``n`` tokens were sampled at ``t``. Returns the inter-token gap, None for the first
        token (which also ends prefill unless ``mark_prefill_end`` was called)."""
        gap = None if self.last_token_time is None else t - self.last_token_time
        if self.first_token_time is None:
            self.first_token_time = t
            self.mark_prefill_end(t)
        self.last_token_time = t
        self.num_output_tokens += n
        return gap

    def mark_prefill_end(self, t: float) -> None:
        if self.prefill_end_time is None:
            self.prefill_end_time = t

    def update_from_metrics(self, metrics: RequestMetrics) -> None:
        """Adopt the timestamps an engine already keeps in :class:`RequestMetrics` (and its
        detokenizer runs, which become the ``detokenizer`` stage span)."""
        self.arrival_time = metrics.arrival_time
        detok = metrics.detokenize
        if detok is not None:
            self._stages[STAGE_DETOKENIZER] = _StageRecord(
                detok.start, detok.end, detok.calls, detok.busy_s
            )
        self.first_scheduled_time = metrics.first_scheduled_time or self.first_scheduled_time
        if metrics.first_token_time is not None:  # prefill ends with the first token
            self.first_token_time = self.prefill_end_time = metrics.first_token_time
        self.last_token_time = metrics.last_token_time or self.last_token_time
        self.num_cached_tokens = metrics.num_cached_prompt_tokens
        self.num_preemptions = metrics.num_preemptions
        if metrics.guided_compile_s is not None:  # structured output: its grammar, at arrival
            start = metrics.arrival_time
            self._stages[STAGE_GUIDED] = _StageRecord(
                start,
                start + metrics.guided_compile_s,
                1,
                metrics.guided_compile_s,
                {
                    A.GUIDED_KIND: metrics.guided_kind or "",
                    A.GUIDED_COMPILE_MS: round(metrics.guided_compile_s * 1000, 3),
                    A.GUIDED_CACHE_HIT: bool(metrics.guided_cache_hit),
                },
            )

    # --- stages -----------------------------------------------------------------------------------
    def record_stage(
        self,
        name: str,
        start: float,
        end: float,
        attributes: Mapping[str, AttributeValue] | None = None,
    ) -> None:
        """Record one run of stage ``name`` (repeated runs coalesce into one span)."""
        rec = self._stages.get(name)
        if rec is None:
            self._stages[name] = _StageRecord(start, end, 1, end - start, dict(attributes or {}))
            return
        rec.start, rec.end = min(rec.start, start), max(rec.end, end)
        rec.calls += 1
        rec.busy += end - start
        rec.attributes.update(attributes or {})

    # --- end of life ------------------------------------------------------------------------------
    def timings(self) -> RequestTimings:
        # RequestTrace keeps each RequestTimings field under the same name
        return RequestTimings(**{f.name: getattr(self, f.name) for f in fields(RequestTimings)})

    def finish(
        self,
        finish_reason: str | None,
        finish_time: float | None = None,
        *,
        error: str | None = None,
    ) -> RequestTimings:
        """Close the request: set ``finished_time`` and emit all its spans (once; later calls
        only return the timings). ``finish_reason``: stop | length | abort | error."""
        if self.finished_time is None:
            t = time.time() if finish_time is None else finish_time
            self.finished_time = max(t, self.last_token_time or t, self.arrival_time)
            self.finish_reason = finish_reason
            self._emit(error)
        return self.timings()

    @isolated(None)
    def _emit(self, error: str | None) -> None:
        if self.tracer is None or not self._span.is_recording():
            return
        timings = self.timings()
        for name, rec in self._stages.items():
            attrs: dict[str, AttributeValue] = {
                A.STAGE_NAME: name, A.STAGE_CALLS: rec.calls, A.STAGE_BUSY_TIME: rec.busy
            }
            emit_span(
                self.tracer,
                name,
                parent=self._stage_parent,
                start_time=rec.start,
                end_time=rec.end,
                attributes={**rec.attributes, **attrs},
            )
        self._emit_queue_and_compute(timings)
        self._finish_llm_request_span(timings, error)

    def _emit_queue_and_compute(self, timings: RequestTimings) -> None:
        assert self.tracer is not None and timings.finished_time is not None
        tracer, parent, end = self.tracer, self._span, timings.finished_time
        queue_end = self.first_scheduled_time if self.first_scheduled_time is not None else end
        emit_span(
            tracer, A.SPAN_QUEUE, parent=parent, start_time=self.arrival_time, end_time=queue_end
        )
        if self.first_scheduled_time is None:
            return  # aborted while waiting: no compute at all
        steps = {
            A.NUM_PREFILL_STEPS: self.num_prefill_steps,
            A.NUM_DECODE_STEPS: self.num_decode_steps,
        }
        compute = emit_span(
            tracer,
            A.SPAN_COMPUTE,
            parent=parent,
            start_time=self.first_scheduled_time,
            end_time=end,
            attributes={**steps, A.NUM_PREEMPTIONS: self.num_preemptions},
        )
        prefill_end = self.prefill_end_time if self.prefill_end_time is not None else end
        prefill_attrs = {
            A.NUM_PREFILL_STEPS: self.num_prefill_steps,
            A.GEN_AI_USAGE_INPUT_TOKENS: self.num_prompt_tokens,
            A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: self.num_cached_tokens,
        }
        emit_span(
            tracer,
            A.SPAN_PREFILL,
            parent=compute,
            start_time=self.first_scheduled_time,
            end_time=prefill_end,
            attributes=prefill_attrs,
        )
        # a decode phase exists once a decode row ran; a max_tokens=1 request is prefill only
        decoded = self.num_decode_steps > 0 or self.num_output_tokens > 1
        if self.prefill_end_time is not None and decoded:
            emit_span(
                tracer,
                A.SPAN_DECODE,
                parent=compute,
                start_time=self.prefill_end_time,
                end_time=end,
                attributes={A.NUM_DECODE_STEPS: self.num_decode_steps},
            )

    def _finish_llm_request_span(self, timings: RequestTimings, error: str | None) -> None:
        assert timings.finished_time is not None
        attrs: dict[str, AttributeValue] = {
            **timings.latency_attributes(),
            A.GEN_AI_USAGE_INPUT_TOKENS: self.num_prompt_tokens,
            A.GEN_AI_USAGE_OUTPUT_TOKENS: self.num_output_tokens,
            A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: self.num_cached_tokens,
            A.NUM_PREEMPTIONS: self.num_preemptions,
        }
        if self.finish_reason is not None:
            attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] = [self.finish_reason]
        self._span.set_attributes(attrs)
        if error is not None or self.finish_reason == "error":
            self._span.set_attribute(A.ERROR_TYPE, error or "error")
            self._span.set_status(Status(StatusCode.ERROR, error or "error"))
        self._span.end(end_time=to_ns(timings.finished_time))
