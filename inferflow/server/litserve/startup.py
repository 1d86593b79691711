"""Per-API-process startup and shutdown, as an ASGI middleware on the lifespan events.

LitServe runs its app's lifespan in every API process; this middleware (passed through
``LitServer(middlewares=...)``, LitServe's public way to add ASGI middleware) starts what each
process owns once it is forked: its tracer and HTTP metrics, and the embedding encoders (loaded
in the background; ``/ready`` waits for them). On shutdown it closes them again.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflow.server.http.frontend import Frontend


class ApiProcessStartup:
    """Runs ``frontend``'s per-process start on ``lifespan.startup`` and its stop on
    ``lifespan.shutdown``; every other scope passes straight through."""

    def __init__(self, app: ASGIApp, frontend: Frontend) -> None:
        self.app = app
        self.frontend = frontend
        self._loading: asyncio.Future[Any] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def observed() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
            return message

        await self.app(scope, observed, send)

    def start(self) -> None:
        self.frontend.telemetry.start()
        embeddings = self.frontend.embeddings
        if embeddings is not None:  # encoders live in each API process
            self._loading = asyncio.get_running_loop().run_in_executor(
                None, embeddings.models.start
            )

    async def stop(self) -> None:
        embeddings = self.frontend.embeddings
        if self._loading is not None:
            with contextlib.suppress(BaseException):
                await self._loading
        if embeddings is not None:
            embeddings.models.close()
        self.frontend.telemetry.stop()
