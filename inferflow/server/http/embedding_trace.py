"""Spans of one embeddings request: root SERVER span ``embeddings {model}`` (continuing an
incoming ``traceparent``) with ``queue`` (dynamic batcher) and ``compute`` (encoder) children."""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request

from inferflow.embeddings.service import EmbeddingResult, EmbeddingService

logger = logging.getLogger(__name__)


class EmbeddingTrace:
    """Inert when tracing is off (``tracer`` None); telemetry failures never fail the request."""

    def __init__(self, tracer: Any, request: Request, arrival: float) -> None:
        self.tracer, self.request, self.arrival = tracer, request, arrival
        self.root: Any = None

    def start(self, model: str) -> None:
        if self.tracer is None:
            return
        from inferflow.telemetry import start_request_span

        self.root = start_request_span(
            self.tracer,
            operation="embeddings",
            model=model,
            headers=dict(self.request.headers),
            start_time=self.arrival,
        )

    def finished(
        self, service: EmbeddingService, submitted: float, result: EmbeddingResult
    ) -> None:
        if self.root is None:
            return
        try:
            from inferflow.telemetry import emit_span

            queued = submitted + result.queue_time_s
            attrs = {
                "gen_ai.response.model": service.model_name,
                "inferflow.model.version": service.model_version,
            }
            computed = queued + result.compute_time_s
            for name, start, end in (("queue", submitted, queued), ("compute", queued, computed)):
                emit_span(
                    self.tracer, name, parent=self.root, start_time=start, end_time=end,
                    attributes=attrs,
                )
            self.root.set_attributes({**attrs, "gen_ai.usage.input_tokens": result.prompt_tokens})
        except Exception:  # telemetry never fails a request
            logger.debug("embedding spans failed", exc_info=True)

    def end(self, status: int) -> None:
        if self.root is None:
            return
        try:
            self.root.set_http_status(status)
            self.root.end()
        except Exception:
            logger.debug("ending the embedding span failed", exc_info=True)
