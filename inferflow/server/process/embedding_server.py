"""An embedding-only server (``python -m inferflow +model=minilm batching=dynamic``).

No LLM, so no LitServe engine worker: one process runs uvicorn + FastAPI, and the encoders run
in it (``EmbeddingModels``: one ORT session + ``DynamicBatcher`` thread per version, loaded at
startup off the event loop; ``/ready`` is 503 until they are warm). The batcher threads release
the GIL inside ONNX Runtime, so the event loop keeps accepting and parsing requests while a batch
runs. SIGTERM/SIGINT: uvicorn stops accepting, lets in-flight requests finish, then the batchers
close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import inferflow
from inferflow.config.server import ServerConfig
from inferflow.embeddings.models import embedding_specs
from inferflow.server.http.connections import raise_fd_limit, uvicorn_connection_options
from inferflow.server.http.embeddings import (
    EMBEDDINGS_PATH,
    EmbeddingModels,
    EmbeddingsFrontend,
    model_not_found,
    unsupported_route,
)
from inferflow.server.http.errors import install_error_handlers
from inferflow.server.http.json_body import read_json_body
from inferflow.server.http.limits import (
    ApiKeyAuth,
    DocsKeyMiddleware,
    PayloadLimitMiddleware,
    RateLimiter,
)
from inferflow.server.http.openapi import install_openapi
from inferflow.server.observability import FrontendTelemetry, TelemetrySettings
from inferflow.telemetry.metrics_export import render_metrics

if TYPE_CHECKING:
    from inferflow.graph import ServingGraph

logger = logging.getLogger(__name__)


class EmbeddingApp:
    """The FastAPI app of an embedding-only server."""

    def __init__(
        self,
        models: EmbeddingModels,
        settings: ServerConfig,
        telemetry: FrontendTelemetry | None = None,
    ) -> None:
        self.models = models
        self.settings = settings
        self.draining = False
        self.created = int(time.time())
        self.telemetry = telemetry or FrontendTelemetry(None)
        auth = ApiKeyAuth.for_server(settings)
        self.frontend = EmbeddingsFrontend(
            models,
            auth,
            lambda: self.draining,
            tracer=lambda: self.telemetry.tracer,
            limiter=RateLimiter(
                settings.rate_limit_requests_per_minute,
                settings.rate_limit_tokens_per_minute,
                auth.key_ids,
            ),
        )
        self.app = FastAPI(title="inferflow", lifespan=self.lifespan)
        self.app.add_middleware(PayloadLimitMiddleware, max_bytes=settings.max_payload_bytes)
        self.app.add_middleware(DocsKeyMiddleware, auth=self.frontend.auth)
        install_error_handlers(self.app)
        install_openapi(
            self.app,
            lambda: [card["id"] for card in self.models.cards(self.created)],
            "OpenAI-compatible embedding server",
        )
        self._routes()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.telemetry.start()
        loading = asyncio.get_running_loop().run_in_executor(None, self.models.start)
        try:
            yield
        finally:
            self.draining = True
            with contextlib.suppress(Exception):
                await loading
            self.models.close()
            self.telemetry.stop()

    def readiness(self) -> str:
        if self.draining:
            return "draining"
        return "ready" if self.models.ready else "not_ready"

    def _routes(self) -> None:
        app, frontend = self.app, self.frontend
        app.add_api_route(EMBEDDINGS_PATH, frontend.embeddings, methods=["POST"])
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.add_api_route(path, self._unsupported(path), methods=["POST"])
        app.add_api_route("/v1/models", self.list_models, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/ready", self.ready, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/admin/stats", self.admin_stats, methods=["GET"])
        app.add_api_route("/version", self.version, methods=["GET"])

    def _unsupported(self, route: str) -> Any:
        async def handler(request: Request) -> Response:
            self.frontend.auth.authenticate(request.headers)
            body = await read_json_body(request)
            model = str(body.get("model", "")) if isinstance(body, dict) else ""
            if self.models.serves(model):
                raise unsupported_route(model, route)
            raise model_not_found(model)

        return handler

    async def list_models(self, request: Request) -> JSONResponse:
        self.frontend.auth.authenticate(request.headers)
        return JSONResponse({"object": "list", "data": self.models.cards(self.created)})

    async def health(self) -> JSONResponse:
        return JSONResponse({"status": "ok", "ready": self.readiness() == "ready"})

    async def ready(self) -> JSONResponse:
        status = self.readiness()
        body: dict[str, Any] = {"status": status}
        if self.models.error:
            body["error"] = self.models.error
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    async def metrics(self, request: Request) -> Response:
        if not self.settings.public_metrics:
            self.frontend.auth.authenticate(request.headers)
        body, content_type = render_metrics(self.frontend.metrics.registry)
        return Response(content=body, media_type=content_type)

    async def admin_stats(self, request: Request) -> JSONResponse:
        self.frontend.auth.authorize_admin(request.headers)
        return JSONResponse({"status": self.readiness(), "embeddings": self.models.stats()})

    async def version(self, request: Request) -> JSONResponse:
        self.frontend.auth.authenticate(request.headers)
        models = [
            {"id": s.model_id, "path": Path(s.path).name} for s in self.models.specs
        ]
        return JSONResponse({"inferflow": inferflow.__version__, "models": models})


def serve_embeddings(graph: ServingGraph) -> None:
    """Serve the graph's embedding models until SIGTERM/SIGINT (blocking)."""
    settings = graph.server.with_env_api_keys()
    settings = replace(settings, max_connections=raise_fd_limit(settings.max_connections))
    models = EmbeddingModels(embedding_specs(graph))
    tracing = dict(graph.to_container().get("tracing") or {})
    telemetry = FrontendTelemetry(TelemetrySettings(graph.model_name, tracing))
    app = EmbeddingApp(models, settings, telemetry)
    logger.info(
        "embedding server: %s on http://%s:%d",
        ", ".join(models.router.model_ids()),
        settings.host,
        settings.port,
    )
    uvicorn.run(
        app.app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) or None,
        **uvicorn_connection_options(settings),
    )
