"""Operational routes: liveness, readiness, versions and an admin view of the engine.

They run in the API processes, where the engine does not live, so they read the state the
worker publishes (``SharedState``): ``/ready`` is 200 only after the worker loaded its engine,
ran a warm-up step and started consuming requests, and turns 503 while draining or restarting.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

import inferflow
from inferflow.server.http.frontend import Frontend

_RUNTIME_PACKAGES = ("litserve", "fastapi", "uvicorn", "onnxruntime", "onnx", "numpy", "tokenizers")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def runtime_versions() -> dict[str, Any]:
    versions: dict[str, Any] = {"python": platform.python_version()}
    versions.update({name: _version(name) for name in _RUNTIME_PACKAGES})
    return versions


def readiness(frontend: Frontend) -> str:
    if frontend.draining or frontend.shared.draining:
        return "draining"
    embeddings_ready = frontend.embeddings is None or frontend.embeddings.models.ready
    if not (frontend.shared.ready and embeddings_ready):
        return "not_ready"
    stall = frontend.settings.worker_stall_timeout_s
    if stall is not None and frontend.shared.heartbeat_age() > stall:
        return "stalled"  # the engine thread stopped going round: 503 until it does or restarts
    return "ready"


Route = tuple[str, Callable[..., Any], list[str]]  # (path, endpoint, methods): a LitSpec endpoint


def ops_routes(frontend: Frontend, model_path: str) -> list[Route]:
    """``/health``, ``/ready``, ``/version``, ``/metrics`` and ``/admin/stats``, registered as
    spec routes (``LitSpec.add_endpoint``)."""

    async def health() -> JSONResponse:
        """Liveness: the API process answers; says nothing about the model."""
        return JSONResponse({"status": "ok", "ready": readiness(frontend) == "ready"})

    async def ready() -> JSONResponse:
        status = readiness(frontend)
        return JSONResponse({"status": status}, status_code=200 if status == "ready" else 503)

    async def metrics(request: Request) -> Response:
        """Prometheus text: the engine's and every API process's metrics, merged. With API keys
        on it needs one too, unless ``server.public_metrics`` (scrapers without a key)."""
        if not frontend.settings.public_metrics:
            frontend.auth.authenticate(request.headers)
        body, content_type = frontend.telemetry.render_metrics()
        return Response(content=body, media_type=content_type)

    return [
        ("/health", health, ["GET"]),
        ("/ready", ready, ["GET"]),
        ("/version", _version_route(frontend, model_path), ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/admin/stats", _admin_stats_route(frontend), ["GET"]),
    ]


def _version_route(frontend: Frontend, model_path: str) -> Callable[[Request], Any]:
    async def version(request: Request) -> JSONResponse:
        """Versions and settings (needs a key when keys are on; no filesystem paths)."""
        frontend.auth.authenticate(request.headers)
        info = frontend.shared.info()
        model = {
            "name": frontend.pipeline.model_name,
            "path": Path(model_path).name,  # the checkpoint folder's name, not where it lives
            "max_model_len": frontend.pipeline.max_model_len,
            **info.get("model", {}),
        }
        return JSONResponse(
            {
                "inferflow": inferflow.__version__,
                "model": model,
                "engine": info.get("engine"),  # null until the worker has loaded it
                "runtime": runtime_versions(),
            }
        )

    return version


def _admin_stats_route(frontend: Frontend) -> Callable[[Request], Any]:
    async def admin_stats(request: Request) -> JSONResponse:
        """Running/waiting requests, free slots and KV blocks, cancellation counters."""
        frontend.auth.authenticate(request.headers)
        engine = frontend.shared.stats()
        return JSONResponse(
            {
                "status": readiness(frontend),
                "in_flight": frontend.shared.in_flight,
                "api_process": {
                    "consumer_id": frontend.consumer_id,
                    "open_requests": len(frontend.registry),
                },
                "engine": {
                    **{k: int(v) if float(v).is_integer() else v for k, v in engine.items()},
                    "executor": frontend.shared.executor_stats(),
                },
                "embeddings": (
                    frontend.embeddings.models.stats() if frontend.embeddings is not None else {}
                ),
            }
        )

    return admin_stats
