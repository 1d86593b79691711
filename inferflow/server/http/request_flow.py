"""One admitted request in an API process, from submission to its last byte.

A ``RequestFlow`` reads the request's channel and renders it: SSE events for a stream, one JSON
body otherwise. It ends exactly once (``Frontend.finish``): whatever the outcome, the root span
gets the usage, finish reason, timings and status, and the admission slot is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inferflow.server.http.channels import RequestChannel
from inferflow.server.http.errors import CLIENT_CLOSED, OpenAIError
from inferflow.server.http.response_pipeline import ResponseRun
from inferflow.server.http.responses import Accumulated, ResponseFormatter
from inferflow.server.http.sse import wait_for_disconnect
from inferflow.server.messages import ErrorInfo, RequestUpdate

if TYPE_CHECKING:
    from inferflow.server.http.deployments import Deployment
    from inferflow.telemetry.spans import RequestSpan

WORKER_GRACE_S = 5.0  # how long past its deadline we wait for the worker's own 504
DONE_EVENT = "data: [DONE]\n\n"


def sse_data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class RequestFlow:
    """State of one submitted request; ``span`` is its root span (None without telemetry)."""

    request_id: str
    channel: RequestChannel
    formatter: ResponseFormatter
    deadline: float | None
    route: str
    started: float
    span: RequestSpan | None = None
    stream: bool = False
    acc: Accumulated = field(default_factory=Accumulated)
    error: ErrorInfo | None = None  # how it failed, once it has
    responses: ResponseRun | None = None  # the response stages, if the graph has any
    deployment: Deployment | None = None  # the model version it runs on

    async def next_update(self) -> RequestUpdate:
        """The merged updates since the last call; a silent worker past the deadline is a 504."""
        budget = None
        if self.deadline is not None:
            budget = max(0.0, self.deadline + WORKER_GRACE_S - time.time())
        try:
            update = await self.channel.next(budget)
        except asyncio.TimeoutError:
            update = RequestUpdate(
                self.request_id,
                error=ErrorInfo(
                    504, "the engine did not answer within the request timeout", code="timeout"
                ),
            )
        if self.responses is not None:
            update = self.responses.apply(update)
        self.acc.add(update)
        self.error = update.error or self.error
        return update

    async def events(self) -> AsyncIterator[str]:
        """The SSE stream: chunks until the final one, then usage (if asked) and ``[DONE]``."""
        fmt = self.formatter
        for start in fmt.start_chunks():
            yield sse_data(start)
        while True:
            update = await self.next_update()
            if update.error is not None:
                text = fmt.take_held_text() + update.text
                if text:  # text produced before the failure still reaches the client
                    yield sse_data(fmt.text_chunk(self.request_id, text))
                yield update.error.sse_event()
                yield DONE_EVENT
                return
            for chunk in fmt.delta_chunks(update):
                yield sse_data(chunk)
            if update.final:
                if fmt.include_usage:
                    yield sse_data(fmt.usage_chunk(self.acc))
                yield DONE_EVENT
                return

    async def _collect(self) -> RequestUpdate:
        while True:
            update = await self.next_update()
            if update.final:
                return update

    async def respond(self, request: Request) -> Response:
        """Non-streaming: wait for the final update unless the client hangs up first."""
        collect = asyncio.ensure_future(self._collect())
        gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (collect, gone):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if collect not in done:
            self.error = CLIENT_CLOSED
            return Response(status_code=499)  # nobody is listening
        final = collect.result()
        if final.error is not None:
            raise OpenAIError(final.error)
        return JSONResponse(self.formatter.full(self.acc), headers=self.acc.timing_headers())

    def end_span(self, status_code: int) -> None:
        """Usage, finish reason, timings and status on the root span, then end it."""
        span, acc = self.span, self.acc
        if span is None:
            return
        span.set_response(
            finish_reasons=[acc.finish_reason] if acc.finish_reason else None,
            input_tokens=acc.prompt_tokens,
            output_tokens=acc.completion_tokens,
            cached_input_tokens=acc.cached_tokens,
            response_id=self.formatter.id,
            response_model=self.formatter.model,
        )
        if acc.timings:
            span.set_timings(acc.timings)
        span.set_http_status(status_code)
        if self.error is not None:
            span.record_error(self.error.message, self.error.code or self.error.error_type)
        span.end()
