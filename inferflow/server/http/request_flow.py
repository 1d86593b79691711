"""One admitted request in an API process, from submission to its last byte.

A request is one engine request per choice (``ChoiceFlow``): a completion with k prompts and
``n`` (or ``best_of``) sequences fans out into k*n of them, choice ``prompt_index * n + i``.
A ``RequestFlow`` reads their channels and renders them: SSE events for a stream (each chunk
carries its choice's ``index``; the usage chunk comes last), one JSON body otherwise. A failure
of any choice fails the whole response (the frontend cancels the others). It ends exactly once
(``Frontend.finish``): whatever the outcome, the root span gets the usage, finish reasons,
timings and status, and the admission slots are released.
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
class ChoiceFlow:
    """One engine request: choice ``formatter.index`` of its HTTP request.

    ``leader``: the first choice of its prompt (it computes the prompt, and its prompt logprobs
    when asked); the others share ``prompt`` with it.
    """

    request_id: str
    channel: RequestChannel
    formatter: ResponseFormatter
    deadline: float | None
    prompt_index: int = 0
    leader: bool = True
    acc: Accumulated = field(default_factory=Accumulated)
    responses: ResponseRun | None = None  # the response stages, if the graph has any
    held: RequestUpdate | None = None  # (a stream) kept back until the prompt logprobs arrive

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
        prompt = self.formatter.prompt
        if update.prompt_logprobs is not None and prompt is not None:
            prompt.logprobs = update.prompt_logprobs
        return update

    async def collect(self) -> RequestUpdate:
        while True:
            update = await self.next_update()
            if update.final:
                return update

    def waits_for_prompt(self) -> bool:
        """A sibling whose rendering needs the logprobs its leader has not received yet."""
        prompt = self.formatter.prompt
        return (
            not self.leader
            and self.formatter.needs_prompt_logprobs()
            and prompt is not None
            and not prompt.ready()
        )


@dataclass
class RequestFlow:
    """State of one submitted HTTP request; ``span`` is its root span (None without telemetry).

    ``n``: choices returned per prompt (``best_of`` generates more; the best ``n`` are kept).
    """

    choices: list[ChoiceFlow]
    route: str
    started: float
    span: RequestSpan | None = None
    stream: bool = False
    n: int = 1
    error: ErrorInfo | None = None  # how it failed, once it has
    deployment: Deployment | None = None  # the model version it runs on

    @property
    def request_id(self) -> str:
        return self.choices[0].request_id

    @property
    def formatter(self) -> ResponseFormatter:
        return self.choices[0].formatter

    @property
    def acc(self) -> Accumulated:
        """The usage so far: each prompt's tokens once, every choice's completion tokens."""
        leaders = [c.acc for c in self.choices if c.leader]
        return Accumulated.total(leaders, [c.acc for c in self.choices])

    async def events(self) -> AsyncIterator[str]:
        """The SSE stream: every choice's chunks as they come, then usage (if asked) and
        ``[DONE]``; the first failing choice ends it with its error event."""
        for choice in self.choices:
            for start in choice.formatter.start_chunks():
                yield sse_data(start)
        waiting = {asyncio.ensure_future(c.next_update()): c for c in self.choices}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: waiting[t].formatter.index):
                    choice = waiting.pop(task)
                    update = task.result()
                    if update.error is not None:
                        self.error = update.error
                        for event in self._failed(choice, update):
                            yield event
                        return
                    if not update.final:
                        waiting[asyncio.ensure_future(choice.next_update())] = choice
                    try:
                        events = [sse_data(c) for c in self._render(choice, update)]
                    except OpenAIError as exc:  # (the engine left out prompt logprobs)
                        self.error = exc.info
                        yield exc.info.sse_event()
                        yield DONE_EVENT
                        return
                    for event in events:
                        yield event
            if self.formatter.include_usage:
                yield sse_data(self.formatter.usage_chunk(self.acc))
            yield DONE_EVENT
        finally:
            for task in waiting:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _render(self, choice: ChoiceFlow, update: RequestUpdate) -> list[dict[str, Any]]:
        """The chunks of ``update``, and of any sibling held back until this update brought
        its prompt's logprobs."""
        if choice.waits_for_prompt():
            choice.held = update if choice.held is None else choice.held.merge(update)
            return []
        chunks = choice.formatter.delta_chunks(update)
        for sibling in self.choices:
            if sibling.held is not None and not sibling.waits_for_prompt():
                held, sibling.held = sibling.held, None
                chunks += sibling.formatter.delta_chunks(held)
        return chunks

    def _failed(self, choice: ChoiceFlow, update: RequestUpdate) -> list[str]:
        events = []
        text = choice.formatter.take_held_text() + update.text
        if text:  # text produced before the failure still reaches the client
            events.append(sse_data(choice.formatter.text_chunk(choice.request_id, text)))
        assert update.error is not None
        return [*events, update.error.sse_event(), DONE_EVENT]

    async def respond(self, request: Request) -> Response:
        """Non-streaming: wait for every choice's final update unless one fails or the client
        hangs up first."""
        collects = {asyncio.ensure_future(c.collect()) for c in self.choices}
        gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
        pending: set[asyncio.Future[Any]] = {*collects, gone}
        try:
            while collects & pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    self.error = CLIENT_CLOSED
                    return Response(status_code=499)  # nobody is listening
                for task in done:
                    final = task.result()
                    if final.error is not None:
                        self.error = final.error
                        raise OpenAIError(final.error)
        finally:
            for task in (*collects, gone):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        kept = self._best()
        body = self.formatter.full_body([c.formatter.full_choice(c.acc) for c in kept], self.acc)
        return JSONResponse(body, headers=self.choices[0].acc.timing_headers())

    def _best(self) -> list[ChoiceFlow]:
        """The returned choices, in order: per prompt, all of them, or with ``best_of`` the
        ``n`` with the highest cumulative logprob, renumbered ``prompt_index * n + i``."""
        per_prompt = len(self.choices) // len({c.prompt_index for c in self.choices})
        if per_prompt == self.n:
            return self.choices
        kept = []
        for start in range(0, len(self.choices), per_prompt):
            group = self.choices[start:start + per_prompt]
            best = sorted(group, key=lambda c: -c.acc.cumulative_logprob)[: self.n]
            best.sort(key=lambda c: c.formatter.index)
            for i, choice in enumerate(best):
                choice.formatter.index = choice.prompt_index * self.n + i
            kept += best
        return kept

    def end_span(self, status_code: int) -> None:
        """Usage, finish reasons, timings and status on the root span, then end it."""
        span, acc = self.span, self.acc
        if span is None:
            return
        reasons = [c.acc.finish_reason for c in self.choices if c.acc.finish_reason]
        span.set_response(
            finish_reasons=reasons or None,
            input_tokens=acc.prompt_tokens,
            output_tokens=acc.completion_tokens,
            cached_input_tokens=acc.cached_tokens,
            response_id=self.formatter.id,
            response_model=self.formatter.model,
        )
        timings = self.choices[0].acc.timings
        if timings:
            span.set_timings(timings)
        span.set_http_status(status_code)
        if self.error is not None:
            span.record_error(self.error.message, self.error.code or self.error.error_type)
        span.end()
