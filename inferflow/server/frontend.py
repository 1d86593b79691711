"""The OpenAI routes' request path inside an API process.

Checks run cheapest first, each failing with OpenAI's error shape::

    413 body too large (middleware) -> 401 API key -> 503 not ready / draining
    -> 400 JSON and schema -> 404 unknown model -> 429 requests/min
    -> request stages (validator, tokenizer, plugins; 400 naming the field) -> 429 tokens/min
    -> 429 waiting queue full -> submit to the engine worker

A submitted request owns one channel; whatever ends it (last token, error, client hang-up,
timeout, shutdown) goes through ``_finish``, which releases its admission slot and, unless the
worker already finished it, sends the worker a ``CancelRequest`` that frees its KV slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inferflow.server.channels import ChannelRegistry, RequestChannel
from inferflow.server.errors import ErrorInfo, OpenAIError, bad_request
from inferflow.server.limits import ApiKeyAuth, RateLimiter
from inferflow.server.messages import CancelRequest, RequestUpdate, SubmitRequest, WorkerLost
from inferflow.server.pipeline import PreparedRequest, RequestPipeline
from inferflow.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from inferflow.server.responses import (
    Accumulated,
    ChatFormatter,
    CompletionFormatter,
    ResponseFormatter,
)
from inferflow.server.settings import ServerSettings
from inferflow.server.shared_state import SharedState
from inferflow.server.sse import SSEResponse, wait_for_disconnect

logger = logging.getLogger(__name__)

WORKER_GRACE_S = 5.0  # how long past a deadline we wait for the worker's own 504
DONE_EVENT = "data: [DONE]\n\n"


def sse_data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class _Flow:
    """One admitted request on its way through this process."""

    request_id: str
    channel: RequestChannel
    formatter: ResponseFormatter
    deadline: float | None
    acc: Accumulated


class Frontend:
    """Handles ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

    def __init__(
        self, pipeline: RequestPipeline, settings: ServerSettings, shared: SharedState
    ) -> None:
        self.pipeline = pipeline
        self.settings = settings
        self.shared = shared
        self.auth = ApiKeyAuth(settings.api_keys)
        self.limiter = RateLimiter(
            settings.rate_limit_requests_per_minute, settings.rate_limit_tokens_per_minute
        )
        self.registry = ChannelRegistry(on_worker_lost=self._worker_lost)
        self.consumer_id = 0  # this process's response queue; set before the API process forks
        self.request_queue: Any = None  # LitServe's request queue (a Manager proxy)
        self.draining = False
        self.created = int(time.time())

    # --- routes -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, CompletionFormatter)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, ChatFormatter)

    async def models(self, request: Request) -> Response:
        self.auth.authenticate(request.headers)
        card = {
            "id": self.pipeline.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "inferflow",
            "max_model_len": self.pipeline.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    # --- admission ----------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.draining or self.shared.draining:
            raise OpenAIError.of(503, "The server is shutting down.", code="shutting_down")
        if not self.shared.ready:
            raise OpenAIError.of(
                503,
                "The model is not ready yet (loading or restarting).",
                code="not_ready",
                retry_after_s=1,
            )

    def _admission_limit(self) -> int | None:
        waiting = self.settings.max_waiting_requests
        if waiting is None:
            return None
        return int(self.shared.stats()["total_slots"]) + waiting

    def _admit(self) -> None:
        if not self.shared.try_admit(self._admission_limit()):
            raise OpenAIError(
                ErrorInfo(
                    429,
                    "The server is at capacity: its waiting queue is full. Retry later.",
                    code="queue_full",
                    retry_after_s=1,
                )
            )

    async def _read_json(self, request: Request) -> Any:
        body = await request.body()
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}", None) from None

    async def _serve(self, request: Request, schema: type, formatter_cls: type) -> Response:
        key_id = self.auth.authenticate(request.headers)
        self.check_accepting()
        body = parse_body(schema, await self._read_json(request))
        if body.model != self.pipeline.model_name:
            raise OpenAIError.of(
                404,
                f"The model `{body.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        self.limiter.check_request(key_id)
        prepared = await self.pipeline.prepare(body, key_id, request.headers)
        self.limiter.check_tokens(key_id, prepared.reserved_tokens)
        self._admit()
        try:
            flow = self._submit(
                prepared,
                formatter_cls(
                    self.pipeline.model_name,
                    body.include_usage,
                    prepared.params.logprobs is not None,
                ),
            )
        except BaseException:
            self.shared.release()
            raise
        if body.stream:
            return SSEResponse(self._events(flow), on_close=lambda gone: self._finish(flow, gone))
        try:
            return await self._respond(request, flow)
        finally:
            await self._finish(flow, client_gone=False)

    # --- engine round trip --------------------------------------------------------------------
    def _submit(self, prepared: PreparedRequest, formatter: ResponseFormatter) -> _Flow:
        now = time.time()
        timeout = self.settings.request_timeout_s
        deadline = now + timeout if timeout else None
        request_id = f"req-{uuid.uuid4().hex}"
        channel = self.registry.open(request_id)
        message = SubmitRequest(
            request_id=request_id,
            consumer_id=self.consumer_id,
            prompt_token_ids=prepared.prompt_token_ids,
            params=prepared.params,
            arrival_time=prepared.arrival_time,
            deadline=deadline,
            priority=prepared.priority,
            trace_context=prepared.trace_context,
        )
        try:
            self.request_queue.put(message)
        except Exception as exc:
            self.registry.close(request_id)
            logger.error("cannot reach the engine worker's queue: %s", exc)
            raise OpenAIError.of(
                503, "The engine worker is unavailable.", code="not_ready"
            ) from None
        return _Flow(request_id, channel, formatter, deadline, Accumulated())

    async def _next(self, flow: _Flow) -> RequestUpdate:
        budget = (
            None
            if flow.deadline is None
            else max(0.0, flow.deadline + WORKER_GRACE_S - time.time())
        )
        try:
            update = await flow.channel.next(budget)
        except asyncio.TimeoutError:
            update = RequestUpdate(
                flow.request_id,
                error=ErrorInfo(
                    504, "the engine did not answer within the request timeout", code="timeout"
                ),
            )
        flow.acc.add(update)
        return update

    async def _events(self, flow: _Flow) -> AsyncIterator[str]:
        """The SSE stream: chunks until the final one, then usage (if asked) and ``[DONE]``."""
        for chunk in flow.formatter.start_chunks():
            yield sse_data(chunk)
        while True:
            update = await self._next(flow)
            if update.error is not None:
                if update.text:  # text produced before the failure still reaches the client
                    yield sse_data(flow.formatter.text_chunk(flow.request_id, update.text))
                yield update.error.sse_event()
                yield DONE_EVENT
                return
            chunk = flow.formatter.delta_chunk(update)
            if chunk is not None:
                yield sse_data(chunk)
            if update.final:
                if flow.formatter.include_usage:
                    yield sse_data(flow.formatter.usage_chunk(flow.acc))
                yield DONE_EVENT
                return

    async def _collect(self, flow: _Flow) -> RequestUpdate:
        while True:
            update = await self._next(flow)
            if update.final:
                return update

    async def _respond(self, request: Request, flow: _Flow) -> Response:
        """Non-streaming: wait for the final update unless the client hangs up first."""
        collect = asyncio.ensure_future(self._collect(flow))
        gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (collect, gone):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if collect not in done:
            return Response(status_code=499)  # nobody is listening; the cancel is sent by _finish
        final = collect.result()
        if final.error is not None:
            raise OpenAIError(final.error)
        return JSONResponse(flow.formatter.full(flow.acc), headers=_timing_headers(flow.acc))

    async def _finish(self, flow: _Flow, client_gone: bool) -> None:
        """Release the request; cancel it in the worker unless the worker already ended it."""
        self.registry.close(flow.request_id)
        self.shared.release()
        if flow.channel.worker_done:
            return
        reason = "client_disconnected" if client_gone else "abandoned"
        try:
            self.request_queue.put(CancelRequest(flow.request_id, reason))
        except Exception as exc:  # the worker/Manager is gone; nothing left to free
            logger.debug("cancel of %s not delivered: %s", flow.request_id, exc)

    def _worker_lost(self, notice: WorkerLost) -> None:
        if notice.request_queue is not None:
            self.request_queue = notice.request_queue
        failed = self.fail_all(notice.error)
        logger.error("engine worker lost; failed %d in-flight request(s)", failed)

    def fail_all(self, error: ErrorInfo) -> int:
        """Fail every in-flight request of this process (shutdown after the grace period)."""
        return len(self.registry.fail_all(error))


def _timing_headers(acc: Accumulated) -> dict[str, str]:
    headers = {}
    if acc.queue_time_s is not None:
        headers["X-Inferflow-Queue-Time-Ms"] = f"{acc.queue_time_s * 1000:.3f}"
    if acc.inference_time_s is not None:
        headers["X-Inferflow-Inference-Time-Ms"] = f"{acc.inference_time_s * 1000:.3f}"
    return headers
