"""Decoded spans and per-request analysis, shared by the trace viewer, the notebook and tests.

Input is OTLP protobuf (``ExportTraceServiceRequest``) — from an OTLP-JSON lines file or from an
OTLP receiver — turned into plain :class:`SpanRecord` values with hex ids and Python attributes.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from inferflow.telemetry import attributes as A
from inferflow.telemetry.otlp_json import read_otlp_json_lines

SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
STATUS_CODE_ERROR = 2  # opentelemetry.proto.trace.v1.Status.StatusCode.STATUS_CODE_ERROR


def any_value(value: AnyValue) -> Any:
    """OTLP AnyValue -> Python value (lists for arrays, dicts for key-value lists)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes_dict(value.kvlist_value.values)
    return getattr(value, kind)


def attributes_dict(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class LinkRecord:
    trace_id: str
    span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SpanRecord:
    """One span with hex ids (``parent_span_id`` is ``""`` for a root) and ns timestamps."""

    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: tuple[LinkRecord, ...] = ()
    status_code: int = 0
    resource: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def service_name(self) -> str | None:
        return self.resource.get("service.name")


def spans_from_request(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    """Flatten an OTLP export request into SpanRecords (resource attributes attached)."""
    out: list[SpanRecord] = []
    for resource_spans in request.resource_spans:
        resource = attributes_dict(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                links = tuple(
                    LinkRecord(
                        link.trace_id.hex(), link.span_id.hex(), attributes_dict(link.attributes)
                    )
                    for link in span.links
                )
                out.append(
                    SpanRecord(
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        name=span.name,
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes=attributes_dict(span.attributes),
                        links=links,
                        status_code=span.status.code,
                        resource=resource,
                    )
                )
    return out


def load_spans(paths: Iterable[str | os.PathLike[str]]) -> list[SpanRecord]:
    """All spans of one or more OTLP-JSON lines files (``ValueError`` names a bad line)."""
    return [
        span
        for path in paths
        for req in read_otlp_json_lines(path)
        for span in spans_from_request(req)
    ]


def group_by_trace(spans: Iterable[SpanRecord]) -> dict[str, list[SpanRecord]]:
    """trace id -> its spans sorted by start time."""
    traces: dict[str, list[SpanRecord]] = defaultdict(list)
    for span in spans:
        traces[span.trace_id].append(span)
    return {
        tid: sorted(group, key=lambda s: (s.start_ns, -s.end_ns)) for tid, group in traces.items()
    }


def roots_of(spans: Sequence[SpanRecord]) -> list[SpanRecord]:
    """Spans whose parent is not among ``spans`` (a continued traceparent's parent lives in the
    client, so the SERVER root has a parent id that is not in the file)."""
    ids = {s.span_id for s in spans}
    return [s for s in spans if not s.parent_span_id or s.parent_span_id not in ids]


def children_index(spans: Sequence[SpanRecord]) -> dict[str, list[SpanRecord]]:
    """parent span id -> children sorted by start time (then end: an instant ``queue`` comes
    before the ``compute`` that starts at the same moment)."""
    index: dict[str, list[SpanRecord]] = defaultdict(list)
    for span in sorted(spans, key=lambda s: (s.start_ns, s.end_ns)):
        index[span.parent_span_id].append(span)
    return index


def tree_rows(spans: Sequence[SpanRecord]) -> list[tuple[int, SpanRecord]]:
    """Depth-first ``(depth, span)`` rows from each root, children in start order."""
    index = children_index(spans)
    rows: list[tuple[int, SpanRecord]] = []
    stack = [(0, root) for root in reversed(sorted(roots_of(spans), key=lambda s: s.start_ns))]
    while stack:
        depth, span = stack.pop()
        rows.append((depth, span))
        stack.extend((depth + 1, child) for child in reversed(index.get(span.span_id, ())))
    return rows


def is_request_trace(spans: Sequence[SpanRecord]) -> bool:
    """A request's trace has an ``llm_request`` or a SERVER span (engine steps have neither)."""
    return any(s.name == A.SPAN_LLM_REQUEST or s.kind == SPAN_KIND_SERVER for s in spans)


@dataclass(frozen=True)
class RequestBreakdown:
    """Where one request's time went (seconds). ``other`` = e2e - queue - compute: frontend,
    process hops and stages outside the engine."""

    trace_id: str
    name: str
    request_id: str | None
    start_ns: int
    e2e: float
    queue: float
    prefill: float
    decode: float
    compute: float
    failed: bool

    @property
    def other(self) -> float:
        return max(0.0, self.e2e - self.queue - self.compute)


def _total(spans: Sequence[SpanRecord], name: str) -> float:
    return sum(s.duration_s for s in spans if s.name == name)


def request_breakdown(trace_spans: Sequence[SpanRecord]) -> RequestBreakdown:
    """Queue/compute breakdown of one request trace; e2e is its outermost root's duration."""
    roots = roots_of(trace_spans)
    root = max(roots, key=lambda s: s.end_ns - s.start_ns)
    request_id = next(
        (s.attributes[A.REQUEST_ID] for s in trace_spans if A.REQUEST_ID in s.attributes), None
    )
    return RequestBreakdown(
        trace_id=root.trace_id,
        name=root.name,
        request_id=request_id,
        start_ns=root.start_ns,
        e2e=root.duration_s,
        queue=_total(trace_spans, A.SPAN_QUEUE),
        prefill=_total(trace_spans, A.SPAN_PREFILL),
        decode=_total(trace_spans, A.SPAN_DECODE),
        compute=_total(trace_spans, A.SPAN_COMPUTE),
        failed=any(s.status_code == STATUS_CODE_ERROR for s in trace_spans),
    )


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile (0..100), linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def durations_by_name(spans: Iterable[SpanRecord]) -> dict[str, list[float]]:
    """span name -> durations (s), in first-seen order of names."""
    out: dict[str, list[float]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span.duration_s)
    return out
