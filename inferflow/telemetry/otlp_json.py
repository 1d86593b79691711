"""OTLP-JSON lines: the ``file`` trace exporter and its reader.

File format: one ``ExportTraceServiceRequest`` per line, in OTLP/JSON encoding (the protobuf JSON
mapping with lowerCamelCase keys, 64-bit integers as strings, enums as integers, and
``traceId``/``spanId``/``parentSpanId`` as lowercase hex instead of base64 — as the OTLP spec and
the OpenTelemetry Collector's ``file`` exporter / ``otlpjsonfile`` receiver use).

Several processes (LitServe's API process and its workers) may append to the same file: each
batch is one ``os.write`` on an ``O_APPEND`` descriptor, so lines never interleave on a local
filesystem.
"""

from __future__ import annotations

import base64
import json
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext

from inferflow.json_types import JSONObject, JSONValue

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _convert_ids(request: dict[str, Any], convert: Callable[[str], str]) -> dict[str, Any]:
    """Apply ``convert`` in place to every span/link id field of an OTLP/JSON request dict."""
    for resource_spans in request.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                for holder in (span, *span.get("links", ())):
                    for key in _ID_KEYS:
                        if holder.get(key):
                            holder[key] = convert(holder[key])
    return request


def otlp_dict_to_request(data: JSONObject) -> ExportTraceServiceRequest:
    """OTLP/JSON dict -> protobuf message. Unknown fields are ignored, as OTLP requires."""
    data = json.loads(json.dumps(data))  # a deep copy: the ids are converted in place
    data = _convert_ids(data, lambda hex_id: base64.b64encode(bytes.fromhex(hex_id)).decode())
    return json_format.ParseDict(data, ExportTraceServiceRequest(), ignore_unknown_fields=True)


# --- direct encoder: SDK spans -> OTLP/JSON dict, without building protobuf messages first ----
# (~10x cheaper than encode_spans + MessageToDict; tests check both give the same message)
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200  # opentelemetry.proto.trace.v1.SpanFlags


def _any_value(value: object) -> JSONObject:
    # exact-type fast path first: this runs for every attribute of every span
    if type(value) is str:
        return {"stringValue": value}
    if type(value) is int:
        return {"intValue": str(value)}  # 64-bit integers are strings in JSON
    if type(value) is float and math.isfinite(value):
        return {"doubleValue": value}
    if type(value) is bool:
        return {"boolValue": value}
    if type(value) is list or type(value) is tuple:
        return {"arrayValue": {"values": [_any_value(v) for v in value]}}
    return _any_value_slow(value)


def _any_value_slow(value: object) -> JSONObject:
    if value is None:
        return {}
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):  # non-finite: the protobuf JSON spellings
        text = str(value).replace("inf", "Infinity").replace("nan", "NaN")
        return {"doubleValue": value if math.isfinite(value) else text}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        return {"kvlistValue": {"values": _attributes(value)}}
    if isinstance(value, Sequence):
        return {"arrayValue": {"values": [_any_value(v) for v in value]}}
    raise TypeError(f"cannot encode attribute value of type {type(value).__name__}")


def _attributes(attrs: Mapping[str, object] | None) -> list[JSONValue]:
    return [{"key": str(k), "value": _any_value(v)} for k, v in (attrs or {}).items()]


def _flags(ctx: SpanContext | None) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if ctx is not None and ctx.is_remote else 0)


def _with_optional(data: JSONObject, **optional: JSONValue) -> JSONObject:
    """Add the fields that differ from their protobuf default (JSON omits defaults)."""
    data.update({k: v for k, v in optional.items() if v})
    return data


def _link_dict(link: Link) -> JSONObject:
    ctx = link.context
    data: JSONObject = {"traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}"}
    if link.attributes:
        data["attributes"] = _attributes(link.attributes)
        if link.dropped_attributes:
            data["droppedAttributesCount"] = link.dropped_attributes
    data["flags"] = _flags(ctx)
    return data


def _span_dict(span: ReadableSpan) -> JSONObject:
    ctx = span.get_span_context()
    assert ctx is not None and span.start_time is not None and span.end_time is not None
    trace_state = ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())
    status = _with_optional({}, code=span.status.status_code.value, message=span.status.description)
    events: list[JSONValue] = [
        _with_optional(
            {"timeUnixNano": str(e.timestamp), "name": e.name},
            attributes=_attributes(e.attributes),
            droppedAttributesCount=e.dropped_attributes,
        )
        for e in span.events
    ]
    links: list[JSONValue] = [_link_dict(link) for link in span.links]
    return _with_optional(
        {"traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}"},
        traceState=trace_state,
        parentSpanId=f"{span.parent.span_id:016x}" if span.parent is not None else None,
        flags=_flags(span.parent),
        name=span.name,
        kind=span.kind.value + 1,  # SDK INTERNAL=0 ... ; OTLP SPAN_KIND_INTERNAL=1 ...
        startTimeUnixNano=str(span.start_time),
        endTimeUnixNano=str(span.end_time),
        attributes=_attributes(span.attributes),
        droppedAttributesCount=span.dropped_attributes,
        events=events,
        droppedEventsCount=span.dropped_events,
        links=links,
        droppedLinksCount=span.dropped_links,
    ) | {"status": status}


def spans_to_otlp_dict(spans: Sequence[ReadableSpan]) -> JSONObject:
    """SDK spans -> OTLP/JSON ``ExportTraceServiceRequest`` dict, grouped by resource then scope
    in first-seen order (as the SDK's protobuf encoder groups them)."""
    # keyed by identity: a provider shares one Resource object, and Resource.__hash__ is json.dumps
    groups: dict[int, tuple[Resource, dict[InstrumentationScope | None, list[JSONValue]]]] = {}
    for span in spans:
        _, scopes = groups.setdefault(id(span.resource), (span.resource, {}))
        scopes.setdefault(span.instrumentation_scope, []).append(_span_dict(span))
    resource_spans: list[JSONValue] = []
    for resource, scopes in groups.values():
        scope_spans: list[JSONValue] = []
        for scope, encoded in scopes.items():
            scope_dict = (
                {}
                if scope is None
                else _with_optional(
                    {},
                    name=scope.name,
                    version=scope.version,
                    attributes=_attributes(scope.attributes),
                )
            )
            scope_spans.append(
                _with_optional(
                    {"scope": scope_dict, "spans": encoded},
                    schemaUrl=scope.schema_url if scope else None,
                )
            )
        resource_spans.append(
            _with_optional(
                {
                    "resource": _with_optional({}, attributes=_attributes(resource.attributes)),
                    "scopeSpans": scope_spans,
                },
                schemaUrl=resource.schema_url,
            )
        )
    return {"resourceSpans": resource_spans}


def spans_to_otlp_json_line(spans: Sequence[ReadableSpan]) -> str:
    """Encode finished SDK spans as one OTLP/JSON line (newline included)."""
    return json.dumps(spans_to_otlp_dict(spans), separators=(",", ":"), allow_nan=False) + "\n"


def read_otlp_json_lines(path: str | os.PathLike[str]) -> Iterator[ExportTraceServiceRequest]:
    """Yield one request per non-empty line; a bad line raises ``ValueError`` naming it."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield otlp_dict_to_request(json.loads(line))
            except (ValueError, json_format.ParseError) as exc:
                raise ValueError(f"{path}:{lineno}: not an OTLP/JSON trace request: {exc}") from exc


class OtlpJsonFileSpanExporter(SpanExporter):
    """Appends each exported batch as one OTLP/JSON line to ``path`` (created with its parents).

    Meant to sit behind a ``BatchSpanProcessor``; ``export`` is thread-safe. Past ``max_bytes``
    (0 = never) the file is rotated: ``path`` -> ``path.1`` -> ... -> ``path.<backups>``. Several
    processes may append to one path (a server's API processes and engine worker): rotation
    takes an ``flock`` on ``path.lock``, and a writer whose file was rotated away reopens
    ``path`` before its next batch.
    """

    def __init__(
        self, path: str | os.PathLike[str], max_bytes: int = 0, backups: int = 3
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._fd: int | None = self._open()

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        payload = spans_to_otlp_json_line(spans).encode("utf-8")
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            if self.max_bytes:
                self._follow_rotation()
            view = memoryview(payload)
            while view:  # regular files write everything at once; loop for the contract's sake
                written = os.write(self._fd, view)
                view = view[written:]
            if self.max_bytes and os.fstat(self._fd).st_size >= self.max_bytes:
                self._rotate()
        return SpanExportResult.SUCCESS

    def _follow_rotation(self) -> None:
        """Reopen ``path`` if another process rotated our file away (caller holds the lock)."""
        assert self._fd is not None
        try:
            current = os.stat(self.path).st_ino
        except FileNotFoundError:
            current = -1
        if current != os.fstat(self._fd).st_ino:
            os.close(self._fd)
            self._fd = self._open()

    def _rotate(self) -> None:
        """Shift ``path`` to ``path.1`` (and older ones up), under a cross-process lock."""
        import fcntl

        with open(f"{self.path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if os.stat(self.path).st_size >= self.max_bytes:  # nobody rotated it meanwhile
                    for i in range(self.backups - 1, 0, -1):
                        older = Path(f"{self.path}.{i}")
                        if older.exists():
                            os.replace(older, f"{self.path}.{i + 1}")
                    if self.backups:
                        os.replace(self.path, f"{self.path}.1")
                    else:
                        os.unlink(self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        self._follow_rotation()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is already an os.write: visible to readers, nothing buffered

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
