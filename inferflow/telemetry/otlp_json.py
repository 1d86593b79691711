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
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

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


def _b64_to_hex(value: str) -> str:
    return base64.b64decode(value).hex()


def _hex_to_b64(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode("ascii")


def request_to_otlp_dict(request: ExportTraceServiceRequest) -> dict[str, Any]:
    """Protobuf message -> OTLP/JSON dict (hex ids, integer enums)."""
    data = json_format.MessageToDict(request, use_integers_for_enums=True)
    return _convert_ids(data, _b64_to_hex)


def otlp_dict_to_request(data: dict[str, Any]) -> ExportTraceServiceRequest:
    """OTLP/JSON dict -> protobuf message. Unknown fields are ignored, as OTLP requires."""
    data = _convert_ids(json.loads(json.dumps(data)), _hex_to_b64)  # deep copy, then convert
    return json_format.ParseDict(data, ExportTraceServiceRequest(), ignore_unknown_fields=True)


def spans_to_otlp_json_line(spans: Sequence[ReadableSpan]) -> str:
    """Encode finished SDK spans as one OTLP/JSON line (newline included)."""
    data = request_to_otlp_dict(encode_spans(spans))
    return json.dumps(data, separators=(",", ":")) + "\n"


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

    Meant to sit behind a ``BatchSpanProcessor``; ``export`` is thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        payload = spans_to_otlp_json_line(spans).encode("utf-8")
        with self._lock:
            if self._fd is None:
                return SpanExportResult.FAILURE
            view = memoryview(payload)
            while view:  # regular files write everything at once; loop for the contract's sake
                written = os.write(self._fd, view)
                view = view[written:]
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # every export is already an os.write: visible to readers, nothing buffered

    def shutdown(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
