"""Real OTLP trace receivers for tests: gRPC (``TraceService/Export``) and HTTP
(``POST /v1/traces``, ``application/x-protobuf``), both on 127.0.0.1 with an ephemeral port,
decoding the protobuf payloads into :class:`inferflow.telemetry.trace_model.SpanRecord`.

Reuse in other test folders (e.g. end-to-end server tests)::

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "telemetry"))
    from otlp_receiver import GrpcOtlpReceiver, HttpOtlpReceiver

    with GrpcOtlpReceiver() as rx:                  # rx.endpoint == "http://127.0.0.1:<port>"
        start the server with  tracing=otlp tracing.endpoint=<rx.endpoint>
        spans = rx.wait_for_spans(lambda spans: any(s.name == "llm_request" for s in spans))

``wait_for_spans`` blocks on a condition variable (no polling sleeps) until the predicate holds
or the timeout expires. In-process exporters need no waiting: ``flush_tracing(provider)`` returns
after the receiver answered the export.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from inferflow.telemetry.trace_model import SpanRecord, spans_from_request


class _Sink:
    """Thread-safe store of received export requests and the headers/metadata they came with."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.requests: list[ExportTraceServiceRequest] = []
        self.headers: list[dict[str, str]] = []

    def add(self, request: ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        with self._cond:
            self.requests.append(request)
            self.headers.append(headers)
            self._cond.notify_all()

    def spans(self) -> list[SpanRecord]:
        with self._cond:
            requests = list(self.requests)
        return [span for req in requests for span in spans_from_request(req)]

    def wait_for_spans(
        self, predicate: Callable[[list[SpanRecord]], bool], timeout: float = 10.0
    ) -> list[SpanRecord]:
        """Block until ``predicate(all spans so far)`` holds; TimeoutError otherwise."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: predicate([s for r in self.requests for s in spans_from_request(r)]),
                timeout=timeout,
            )
        if not ok:
            raise TimeoutError(f"OTLP receiver: condition not met within {timeout}s")
        return self.spans()


class GrpcOtlpReceiver(_Sink):
    """An OTLP/gRPC collector endpoint (insecure) implementing ``TraceService.Export``."""

    def __init__(self) -> None:
        super().__init__()
        sink = self

        class _Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: ExportTraceServiceRequest, context: Any) -> Any:
                sink.add(request, {k: v for k, v in context.invocation_metadata()})
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.stop(grace=None)

    def __enter__(self) -> GrpcOtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HttpOtlpReceiver(_Sink):
    """An OTLP/HTTP collector endpoint: ``POST /v1/traces`` with a protobuf body (gzip ok)."""

    def __init__(self) -> None:
        super().__init__()
        sink = self

        class _Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_error(415)
                    return
                request = ExportTraceServiceRequest.FromString(body)
                sink.add(request, {k.lower(): v for k, v in self.headers.items()})
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> HttpOtlpReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
