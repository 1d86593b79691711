"""Span helpers for stage boundaries: the root SERVER span, W3C context carrying across
LitServe's processes, live stage spans, spans with explicit times, and engine-step spans.

Every helper is failure-isolated: if telemetry breaks, the request goes on (with an invalid,
non-recording span); an exception raised by the traced code itself is recorded and re-raised.
Times are ``time.time()`` seconds (floats), the clock of :class:`inferflow.outputs.RequestMetrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar, cast

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from inferflow.telemetry import attributes as A
from inferflow.telemetry.isolation import isolated, log_telemetry_error
from inferflow.telemetry.timings import RequestTimings

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless

Headers = Mapping[str, str] | Iterable[tuple[str, str]]
R = TypeVar("R")  # what a stage wrapper's parent_of reads the parent from


def to_ns(t: float) -> int:
    """``time.time()`` seconds -> integer nanoseconds (OpenTelemetry's timestamps)."""
    return round(t * 1e9)


def extract_context(headers: Headers | None) -> Context:
    """W3C ``traceparent``/``tracestate`` from HTTP headers (any key case) -> Context.

    An absent or malformed ``traceparent`` yields an empty Context (a new trace starts)."""
    if headers is None:
        return Context()
    items = headers.items() if isinstance(headers, Mapping) else headers
    return _PROPAGATOR.extract({str(k).lower(): str(v) for k, v in items}, context=Context())


def traceparent_of(parent: ParentLike) -> str | None:
    """The W3C ``traceparent`` string of a span / span context (None when invalid)."""
    sc = trace.get_current_span(parent_context(parent)).get_span_context()
    if not sc.is_valid:
        return None
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def parent_context(parent: ParentLike) -> Context:
    """Normalise a parent (traceparent string, W3C carrier dict, Context, SpanContext, Span,
    RequestSpan or None) to a Context. ``None`` (or an empty carrier) gives an empty Context: a
    new root, never an ambient current span."""
    if parent is None:
        return Context()
    if isinstance(parent, str):
        return _PROPAGATOR.extract({"traceparent": parent}, context=Context())
    if isinstance(parent, Context):  # before Mapping: a Context is a dict
        return parent
    if isinstance(parent, Mapping):
        return extract_context(cast(Mapping[str, str], parent))
    if isinstance(parent, RequestSpan):
        parent = parent.span
    if isinstance(parent, SpanContext):
        parent = trace.NonRecordingSpan(parent)
    return trace.set_span_in_context(parent, Context())


class RequestSpan:
    """The root SERVER span of one request, in the API process. All methods are isolated."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self._ended = False

    @property
    def traceparent(self) -> str | None:
        """Serializable context to put in the payload sent to the worker process."""
        return traceparent_of(self.span)

    @property
    def trace_context(self) -> dict[str, str]:
        """The same as a W3C carrier dict (``traceparent`` and, if any, ``tracestate``)."""
        carrier: dict[str, str] = {}
        try:
            _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.span, Context()))
        except Exception as exc:
            log_telemetry_error("RequestSpan.trace_context", exc)
        return carrier

    @property
    def is_recording(self) -> bool:
        return self.span.is_recording()

    @isolated(None)
    def set_attributes(self, attributes: Mapping[str, AttributeValue]) -> None:
        self.span.set_attributes(attributes)

    @isolated(None)
    def set_response(
        self,
        *,
        finish_reasons: Sequence[str] | None = None,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        cached_input_tokens: int | None = None,
        response_id: str | None = None,
        response_model: str | None = None,
    ) -> None:
        """GenAI response/usage attributes (``gen_ai.response.*``, ``gen_ai.usage.*``)."""
        values: dict[str, AttributeValue] = {
            A.GEN_AI_RESPONSE_FINISH_REASONS: list(finish_reasons)
            if finish_reasons is not None
            else None,
            A.GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
            A.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
            A.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: cached_input_tokens,
            A.GEN_AI_RESPONSE_ID: response_id,
            A.GEN_AI_RESPONSE_MODEL: response_model,
        }
        self.span.set_attributes({k: v for k, v in values.items() if v is not None})

    @isolated(None)
    def set_timings(self, timings: RequestTimings) -> None:
        """``gen_ai.latency.*`` from the worker's timings."""
        self.span.set_attributes(timings.latency_attributes())

    @isolated(None)
    def set_http_status(self, status_code: int) -> None:
        """``http.response.status_code``; 5xx marks the span as an error (4xx is the client's)."""
        self.span.set_attribute(A.HTTP_RESPONSE_STATUS_CODE, status_code)
        if status_code >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
            self.span.set_attribute(A.ERROR_TYPE, str(status_code))

    @isolated(None)
    def record_error(self, error: BaseException | str, error_type: str | None = None) -> None:
        """Mark the request failed: status ERROR, ``error.type``, and the exception event."""
        if isinstance(error, BaseException):
            self.span.record_exception(error)
            error_type = error_type or type(error).__qualname__
        self.span.set_attribute(A.ERROR_TYPE, error_type or "error")
        self.span.set_status(Status(StatusCode.ERROR, str(error)))

    @isolated(None)
    def end(self, end_time: float | None = None) -> None:
        """End the root span (idempotent); ``end_time`` defaults to now."""
        if not self._ended:
            self._ended = True
            self.span.end(end_time=None if end_time is None else to_ns(end_time))

    def __enter__(self) -> RequestSpan:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.record_error(exc)
        self.end()


def start_request_span(
    tracer: trace.Tracer,
    *,
    operation: str,
    model: str,
    headers: Headers | None = None,
    request_id: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    start_time: float | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> RequestSpan:
    """Start the root SERVER span ``"{operation} {model}"`` (e.g. ``"chat tiny-llama"``),
    continuing the W3C ``traceparent`` in ``headers`` when there is one.

    ``operation`` is a GenAI operation name: ``chat``, ``text_completion``, ``embeddings``.
    Never raises: on a telemetry failure the returned RequestSpan wraps an invalid span.
    """
    values: dict[str, AttributeValue] = {
        A.GEN_AI_OPERATION_NAME: operation,
        A.GEN_AI_PROVIDER_NAME: "inferflow",
        A.GEN_AI_REQUEST_MODEL: model,
        A.GEN_AI_REQUEST_MAX_TOKENS: max_tokens,
        A.GEN_AI_REQUEST_TEMPERATURE: None if temperature is None else float(temperature),
        A.GEN_AI_REQUEST_TOP_P: None if top_p is None else float(top_p),
        A.GEN_AI_REQUEST_SEED: seed,
        A.REQUEST_ID: request_id,
    }
    attrs: dict[str, AttributeValue] = {k: v for k, v in values.items() if v is not None}
    attrs.update(attributes or {})
    name = f"{operation} {model}"
    return RequestSpan(
        start_span(tracer, name, extract_context(headers), attrs, SpanKind.SERVER, start_time)
    )


# what a ``parent=`` argument accepts: a traceparent string or a W3C carrier dict (as carried
# from the API process), a Context, a SpanContext, a Span or a RequestSpan; None: a new trace
ParentLike = str | Mapping[str, str] | Context | SpanContext | Span | RequestSpan | None


@isolated(INVALID_SPAN)
def start_span(
    tracer: trace.Tracer,
    name: str,
    parent: ParentLike,
    attributes: Mapping[str, AttributeValue] | None,
    kind: SpanKind,
    start_time: float | None = None,
    links: Sequence[Link] | None = None,
) -> Span:
    """Start a live span under ``parent`` (None: a new root); an invalid span on failure."""
    return tracer.start_span(
        name,
        context=parent_context(parent),
        kind=kind,
        attributes=dict(attributes or {}),
        links=links,
        start_time=None if start_time is None else to_ns(start_time),
    )


@contextmanager
def stage_span(
    tracer: trace.Tracer | None,
    name: str,
    *,
    parent: ParentLike = None,
    attributes: Mapping[str, AttributeValue] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Iterator[Span]:
    """Trace one stage boundary: ``with stage_span(tracer, "tokenizer", parent=tp): ...``.

    Telemetry failures are swallowed; an exception from the body is recorded on the span (status
    ERROR, ``error.type``) and re-raised unchanged. ``tracer=None`` traces nothing.
    """
    span = INVALID_SPAN if tracer is None else start_span(tracer, name, parent, attributes, kind)
    try:
        yield span
    except BaseException as exc:
        try:
            span.record_exception(exc)
            span.set_attribute(A.ERROR_TYPE, type(exc).__qualname__)
            span.set_status(Status(StatusCode.ERROR, str(exc)))
        except Exception as telemetry_exc:
            log_telemetry_error(f"stage_span({name})", telemetry_exc)
        raise
    finally:
        try:
            span.end()
        except Exception as telemetry_exc:
            log_telemetry_error(f"stage_span({name})", telemetry_exc)


@isolated(INVALID_SPAN)
def emit_span(
    tracer: trace.Tracer,
    name: str,
    *,
    parent: ParentLike,
    start_time: float,
    end_time: float,
    attributes: Mapping[str, AttributeValue] | None = None,
    links: Sequence[Link] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span:
    """Record an already finished interval as a span (explicit start/end times)."""
    span = start_span(tracer, name, parent, attributes, kind, start_time, links)
    span.end(end_time=to_ns(max(end_time, start_time)))
    return span


@isolated(None)
def record_step_span(
    tracer: trace.Tracer,
    *,
    step_id: int,
    start_time: float,
    end_time: float,
    served: Sequence[tuple[str, SpanContext]],
    num_prefill_tokens: int,
    num_decode_tokens: int,
    num_prefill_requests: int = 0,
    num_decode_requests: int = 0,
    batch_size: int | None = None,
    attributes: Mapping[str, AttributeValue] | None = None,
) -> None:
    """One ``engine step`` span (its own trace) linked to the requests it served.

    ``served`` is ``(request_id, llm_request span context)`` per traced batch row: one link per
    row, and the ids in ``inferflow.step.request_ids`` (one array attribute: per-link attributes
    cost the SDK a bounded dict each). ``batch_size`` defaults to ``len(served)``.
    """
    rows = [(rid, sc) for rid, sc in served if sc.is_valid]
    links = [Link(sc) for _, sc in rows]
    attrs: dict[str, AttributeValue] = {
        A.STEP_ID: step_id,
        A.STEP_REQUEST_IDS: [rid for rid, _ in rows],
        A.STEP_BATCH_SIZE: len(served) if batch_size is None else batch_size,
        A.STEP_NUM_PREFILL_TOKENS: num_prefill_tokens,
        A.STEP_NUM_DECODE_TOKENS: num_decode_tokens,
        A.STEP_NUM_BATCHED_TOKENS: num_prefill_tokens + num_decode_tokens,
        A.STEP_NUM_PREFILL_REQUESTS: num_prefill_requests,
        A.STEP_NUM_DECODE_REQUESTS: num_decode_requests,
    }
    attrs.update(attributes or {})
    emit_span(
        tracer,
        A.SPAN_ENGINE_STEP,
        parent=None,
        start_time=start_time,
        end_time=end_time,
        attributes=attrs,
        links=links,
    )


def make_stage_wrapper(
    tracer: trace.Tracer | None, parent_of: Callable[[R], ParentLike]
) -> Callable[[str, R], AbstractContextManager[Span]]:
    """A ``(stage name, request) -> context manager`` wrapper for a stage runner (e.g. the
    server's ``RequestPipeline(wrap_stage=...)``): each stage call becomes a :func:`stage_span`
    under ``parent_of(request)`` (the request's root span context / carrier)."""

    def wrap(name: str, request: R) -> AbstractContextManager[Span]:
        try:
            parent = parent_of(request)
        except Exception as exc:
            log_telemetry_error(f"stage wrapper({name})", exc)
            parent = None
        return stage_span(tracer, name, parent=parent, attributes={A.STAGE_NAME: name})

    return wrap
