"""``POST /v1/embeddings``: OpenAI's embeddings API over one or more ``EmbeddingService``\\ s.

Where the encoders run: in the API process itself. Each served version is an
``EmbeddingService`` (its own ORT session + ``DynamicBatcher`` thread) loaded when the API
process starts (``EmbeddingModels.start``, off the event loop); ``/ready`` waits for it. A
request never crosses a process boundary: parse -> route (``model_routing``) -> tokenize +
queue in the batcher -> await the batch's vectors -> JSON. Metrics are labelled by model name
and version; the version that served a request is in the ``x-inferflow-model-version`` header
and the body's ``model_version`` field.
"""

from __future__ import annotations

import base64
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel, ConfigDict, StrictInt

from inferflow.embeddings.dynamic_batcher import BatcherClosed, QueueFull
from inferflow.embeddings.models import EmbeddingModelSpec
from inferflow.embeddings.service import EmbeddingInputError, EmbeddingService
from inferflow.json_types import JSONValue
from inferflow.server.http.embedding_trace import EmbeddingTrace
from inferflow.server.http.errors import OpenAIError, bad_request
from inferflow.server.http.json_body import read_json_body
from inferflow.server.http.limits import ApiKeyAuth, RateLimiter
from inferflow.server.http.protocol import validate_body
from inferflow.server.routing import ModelRouter, ModelVersion
from inferflow.telemetry.metrics import REQUEST_LATENCY_BUCKETS
from inferflow.telemetry.timings import phase_timing_headers

logger = logging.getLogger(__name__)

EMBEDDINGS_PATH = "/v1/embeddings"


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # no bools as token ids
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    def inputs(self) -> list[str] | list[list[int]]:
        """OpenAI's ``input`` as a list of texts or of token-id lists."""
        if isinstance(self.input, str):
            return [self.input]
        if not self.input:
            raise bad_request("input: must not be empty", "input")
        items: list[Any] = list(self.input)
        if isinstance(items[0], int):
            return [items]
        return items


def parse_embedding_request(body: JSONValue) -> EmbeddingRequest:
    return validate_body(EmbeddingRequest, body)


class EmbeddingMetrics:
    """Prometheus metrics labelled by ``model`` and ``version`` (file-backed in multiprocess
    mode, so ``/metrics`` merges them across API processes)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        labels = ["model", "version"]

        def counter(name: str, text: str) -> Counter:
            return Counter(name, text, labels, registry=registry)

        def histogram(name: str, text: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, text, labels, buckets=buckets, registry=registry)

        self.requests = counter(
            "inferflow:embedding_requests", "Embedding requests served, by model version"
        )
        self.inputs = counter("inferflow:embedding_inputs", "Inputs embedded")
        self.tokens = counter("inferflow:embedding_prompt_tokens", "Tokens embedded")
        self.batch_size = histogram(
            "inferflow:embedding_batch_size",
            "Inputs per encoder call formed by the dynamic batcher",
            (1, 2, 4, 8, 16, 32, 64, 128),
        )
        self.latency = histogram(
            "inferflow:embedding_request_latency_seconds",
            "Embedding request latency (queue + compute)",
            REQUEST_LATENCY_BUCKETS,
        )


class EmbeddingModels:
    """The embedding models of one API process: loading, routing, stats."""

    def __init__(self, specs: Sequence[EmbeddingModelSpec], rng: random.Random | None = None):
        self.specs = list(specs)
        self.router = ModelRouter([ModelVersion(s.name, s.version, s.weight) for s in self.specs], rng)
        self.services: dict[str, EmbeddingService] = {}  # "name@version" -> service
        # (name, version, batch size) -> None, called per formed batch (the frontend's metrics)
        self.batch_observer: Callable[[str, str, int], None] | None = None
        self.error: str | None = None
        self._ready = threading.Event()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def start(self) -> None:
        """Load every version (blocking; run it on a thread). Failures leave ``ready`` False."""
        try:
            for spec in self.specs:
                started = time.time()
                service = EmbeddingService.from_path(
                    spec.path,
                    batching=spec.batching,
                    model_name=spec.name,
                    model_version=spec.version,
                )
                if self.batch_observer is not None:
                    service.on_batch = functools.partial(
                        self.batch_observer, spec.name, spec.version
                    )
                self.services[spec.model_id] = service
                logger.info(
                    "embedding model %s@%s ready in %.2f s",
                    spec.name,
                    spec.version,
                    time.time() - started,
                )
            self._ready.set()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception("loading the embedding models failed")

    def close(self) -> None:
        for service in self.services.values():
            service.close()

    def serves(self, model: str) -> bool:
        return self.router.route(model) is not None

    def route(self, model: str, user: str | None) -> EmbeddingService:
        """The version that serves this request: 404 for an unknown model, 503 until every
        version is loaded."""
        chosen = self.router.route(model, user)
        if chosen is None:
            raise model_not_found(model)
        if not self.ready:
            raise OpenAIError.of(
                503, "The embedding model is not ready yet.", code="not_ready", retry_after_s=1
            )
        return self.services[chosen.model_id]

    def cards(self, created: int) -> list[dict[str, Any]]:
        return [
            {
                "id": mid,
                "object": "model",
                "created": created,
                "owned_by": "inferflow",
                "task": "embed",
            }
            for mid in self.router.model_ids()
        ]

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for mid, service in self.services.items():
            snapshot = asdict(service.stats())
            state = snapshot["worker_state"]
            snapshot["worker_state"] = getattr(state, "value", str(state))
            out[mid] = snapshot
        return out


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError.of(
        404, f"The model `{model}` does not exist.", param="model", code="model_not_found"
    )


class EmbeddingsFrontend:
    """The ``/v1/embeddings`` handler: auth, readiness, parse, route, embed, format."""

    def __init__(
        self,
        models: EmbeddingModels,
        auth: ApiKeyAuth,
        draining: Callable[[], bool],
        on_response: Callable[[str, int, float], None] | None = None,
        tracer: Callable[[], Any] | None = None,
        limiter: RateLimiter | None = None,
    ) -> None:
        self.models = models
        self.auth = auth
        self.draining = draining
        self.on_response = on_response
        self.tracer = tracer  # -> this process's OpenTelemetry tracer (None: tracing off)
        # per-key request and token limits, shared with the LLM routes when both are served
        self.limiter = limiter or RateLimiter(None, None)
        self.metrics = EmbeddingMetrics()
        models.batch_observer = self._observe_batch

    def _observe_batch(self, name: str, version: str, size: int) -> None:
        self.metrics.batch_size.labels(name, version).observe(size)

    async def embeddings(self, request: Request) -> JSONResponse:
        started, status = time.time(), 500
        trace = EmbeddingTrace(self.tracer() if self.tracer is not None else None, request, started)
        try:
            response = await self._handle(request, started, trace)
            status = response.status_code
            return response
        except OpenAIError as exc:
            status = exc.info.status_code
            raise
        finally:
            trace.end(status)
            if self.on_response is not None:
                self.on_response(EMBEDDINGS_PATH, status, time.time() - started)

    async def _handle(
        self, request: Request, started: float, trace: EmbeddingTrace
    ) -> JSONResponse:
        key_id = self.auth.authenticate(request.headers)
        self.limiter.check_request(key_id)
        if self.draining():
            raise OpenAIError.of(503, "The server is shutting down.", code="shutting_down")
        body = parse_embedding_request(await read_json_body(request))
        service = self.models.route(body.model, body.user)
        if body.dimensions is not None and body.dimensions != service.embedding_dim:
            raise bad_request(
                f"dimensions: {service.model_name} produces {service.embedding_dim}-dimensional "
                f"embeddings and cannot shorten them; omit dimensions or pass "
                f"{service.embedding_dim}",
                "dimensions",
            )
        trace.start(body.model)
        try:
            # tokenize here (ids with [CLS]/[SEP], truncated) so the token budget is checked
            # before any work is queued; the service uses token-id inputs as given
            inputs = service.tokenize(body.inputs())
            self.limiter.check_tokens(key_id, sum(len(ids) for ids in inputs))
            submitted = time.time()
            result = await service.embed_async(inputs)
        except EmbeddingInputError as exc:
            raise bad_request(str(exc), exc.field) from None
        except QueueFull:
            raise OpenAIError.of(
                429,
                "The embedding queue is full. Retry later.",
                code="queue_full",
                retry_after_s=1,
            ) from None
        except BatcherClosed:
            raise OpenAIError.of(
                503, "The server is shutting down.", code="shutting_down"
            ) from None
        trace.finished(service, submitted, result)
        labels = (service.model_name, service.model_version)
        self.metrics.requests.labels(*labels).inc()
        self.metrics.inputs.labels(*labels).inc(len(result.vectors))
        self.metrics.tokens.labels(*labels).inc(result.prompt_tokens)
        self.metrics.latency.labels(*labels).observe(time.time() - started)
        return JSONResponse(
            render_embeddings(result.vectors, body.encoding_format, service, result.prompt_tokens),
            headers={
                "x-inferflow-model-version": service.model_version,
                **phase_timing_headers(
                    queue_time_s=result.queue_time_s, inference_time_s=result.compute_time_s
                ),
            },
        )


def render_embeddings(
    vectors: np.ndarray, encoding_format: str, service: EmbeddingService, prompt_tokens: int
) -> dict[str, Any]:
    """OpenAI's response body; ``base64`` is little-endian float32 bytes, as OpenAI sends."""
    data = []
    for i, vec in enumerate(vectors):
        embedding: Any
        if encoding_format == "base64":
            embedding = base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
        else:
            embedding = vec.astype(np.float32).tolist()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return {
        "object": "list",
        "data": data,
        "model": service.model_name,
        "model_version": service.model_version,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def unsupported_route(model: str, route: str) -> OpenAIError:
    """An embedding model asked for completions/chat."""
    return OpenAIError.of(
        400,
        f"The model `{model}` is an embedding model and does not support {route}; "
        "use /v1/embeddings.",
        param="model",
        code="model_not_supported",
    )
