"""Server-Sent Events responses that notice a client hang-up, and disconnect watching.

Starlette's ``StreamingResponse`` only notices a disconnect on ASGI servers older than spec 2.4
and never for a non-streaming handler that is still waiting. Here a watcher task reads ASGI
``receive`` for ``http.disconnect`` while the body streams; when the client goes first, the body
iterator is cancelled and ``on_close(client_gone=True)`` runs, which cancels the request in the
engine. ``on_close`` always runs exactly once, even if streaming never started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body must already have been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """``text/event-stream`` response over an async iterator of ready-made event strings."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[str],
        on_close: Callable[[bool], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        streamer = asyncio.ensure_future(self._stream(send, watcher))
        client_gone = False
        error: BaseException | None = None
        try:
            done, _ = await asyncio.wait({watcher, streamer}, return_when=asyncio.FIRST_COMPLETED)
            if streamer in done:
                error = streamer.exception()
            # a failed send or a failed body means the client did not get a complete stream
            client_gone = streamer not in done or error is not None
        finally:
            for task in (watcher, streamer):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
            await self.on_close(client_gone)
        if error is not None and not isinstance(error, OSError):
            raise error

    async def _stream(self, send: Send, watcher: asyncio.Future[None]) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for event in self.events:
            # the client left (belt and braces: a swallowed cancellation must not keep us going)
            if watcher.done():
                return
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
