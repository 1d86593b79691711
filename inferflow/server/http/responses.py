"""OpenAI response objects: whole completions and streamed chunks, for both endpoints.

One ``ResponseFormatter`` serves one choice of a request (``index``); the choices of one request
share its ``id`` and ``created`` (``sibling``). Streams follow OpenAI's order: (chat: a role chunk,) content chunks, the
last content chunk carrying ``finish_reason``, then — with ``stream_options.include_usage`` — a
chunk with empty ``choices`` and the ``usage``; every other chunk has ``"usage": null`` then.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from inferflow.json_types import JSONObject, JSONValue
from inferflow.server.http.errors import OpenAIError
from inferflow.server.messages import LogprobEntry, RequestUpdate
from inferflow.telemetry.timings import RequestTimings, timing_headers


@dataclass
class Accumulated:
    """Everything a request produced so far (non-streaming responses, final usage)."""

    text: str = ""
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: RequestTimings | None = None  # from the worker, on the last update
    prompt_logprobs: tuple[LogprobEntry | None, ...] | None = None  # (first update)

    def add(self, update: RequestUpdate) -> None:
        self.text += update.text
        self.logprobs.extend(update.logprobs or ())
        self.finish_reason = update.finish_reason or self.finish_reason
        self.prompt_tokens = update.prompt_tokens or self.prompt_tokens
        self.completion_tokens = update.completion_tokens
        self.cached_tokens = update.cached_tokens
        self.timings = update.timings or self.timings
        self.prompt_logprobs = update.prompt_logprobs or self.prompt_logprobs

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the generated tokens' logprobs (``best_of`` ranks choices by it)."""
        return sum(e.logprob for e in self.logprobs)

    @classmethod
    def total(cls, prompts: Sequence[Accumulated], choices: Sequence[Accumulated]) -> Accumulated:
        """The usage of a fanned-out request: each prompt's tokens once (``prompts``: one
        choice per prompt), every choice's completion tokens."""
        return cls(
            prompt_tokens=sum(a.prompt_tokens for a in prompts),
            completion_tokens=sum(a.completion_tokens for a in choices),
            cached_tokens=sum(a.cached_tokens for a in prompts),
        )

    def timing_headers(self) -> dict[str, str]:
        """Queue vs inference time (and a ``server-timing`` header) for a non-streamed reply."""
        return {} if self.timings is None else timing_headers(self.timings)

    def usage(self) -> JSONObject:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class ResponseFormatter(ABC):
    """Builds the JSON objects of one request's response."""

    object_name: str
    chunk_object_name: str
    id_prefix: str
    index: int = 0  # the choice this formatter renders (``prompt_index * n + i``)

    def __init__(self, model: str, include_usage: bool, want_logprobs: bool) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs
        # the choice's prompt (echo, prompt_logprobs); None when the request asks for neither
        self.prompt: PromptInfo | None = None
        self.want_prompt_logprobs = False  # vLLM's ``prompt_logprobs``

    def _envelope(self, object_name: str, choices: list[JSONValue]) -> JSONObject:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }

    def sibling(self, other: ResponseFormatter, index: int) -> ResponseFormatter:
        """This formatter made choice ``index`` of ``other``'s response (same id, created)."""
        self.id, self.created, self.index = other.id, other.created, index
        return self

    def chunk(self, choice: JSONObject) -> JSONObject:
        choice["index"] = self.index  # (whatever index a subclass wrote: this choice's)
        body = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, acc: Accumulated) -> JSONObject:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = acc.usage()
        return body

    def full(self, acc: Accumulated) -> JSONObject:
        return self.full_body([self.full_choice(acc)], acc)

    def full_choice(self, acc: Accumulated) -> JSONObject:
        """This choice of a whole (non-streamed) response."""
        choice = self._full_choice(acc)
        choice["index"] = self.index
        return choice

    def needs_prompt_logprobs(self) -> bool:
        """Whether rendering this choice needs its prompt's logprobs."""
        return self.want_prompt_logprobs

    def full_body(self, choices: list[JSONValue], usage: Accumulated) -> JSONObject:
        """The whole response with ``choices`` (in order) and ``usage``'s token counts."""
        body = self._envelope(self.object_name, choices)
        body["usage"] = usage.usage()
        return body

    def start_chunks(self) -> list[JSONObject]:
        return []

    def delta_chunks(self, update: RequestUpdate) -> list[JSONObject]:
        """The chunks for ``update`` (none when it carries nothing to send)."""
        chunk = self.delta_chunk(update)
        return [] if chunk is None else [chunk]

    def take_held_text(self) -> str:
        """Text received but not sent yet (a formatter that holds text back returns it once)."""
        return ""

    def delta_chunk(self, update: RequestUpdate) -> JSONObject | None:
        """The chunk for ``update`` or ``None`` when it carries nothing to send."""
        if not update.text and update.finish_reason is None and not update.logprobs:
            return None
        return self.chunk(self._delta_choice(update))

    def text_chunk(self, request_id: str, text: str) -> JSONObject:
        """A plain text chunk (the text a failing stream produced before its error event)."""
        return self.chunk(self._delta_choice(RequestUpdate(request_id, text=text)))

    @abstractmethod
    def _delta_choice(self, update: RequestUpdate) -> JSONObject: ...

    @abstractmethod
    def _full_choice(self, acc: Accumulated) -> JSONObject: ...


class CompletionFormatter(ResponseFormatter):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, include_usage: bool, want_logprobs: bool) -> None:
        super().__init__(model, include_usage, want_logprobs)
        self._text_offset = 0  # characters of completion text before the next token
        self.echo = False  # the text (and logprobs) start with the prompt's
        self._echo_pending = True  # (a stream: the first chunk carries the prompt)

    def _logprobs(self, rows: Sequence[LogprobRow]) -> Any:
        if not self.want_logprobs:
            return None
        offsets = []
        for token, _, _ in rows:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "tokens": [token for token, _, _ in rows],
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [top for _, _, top in rows],
            "text_offset": offsets,
        }

    def _echoed(self, text: str, entries: Sequence[LogprobEntry]) -> tuple[str, list[LogprobRow]]:
        """``text`` and its logprob rows, after the prompt's when this choice echoes it."""
        rows = [generated_row(e) for e in entries]
        if not self.echo:
            return text, rows
        assert self.prompt is not None
        prompt_rows = self.prompt.logprob_rows() if self.want_logprobs else []
        return self.prompt.text + text, prompt_rows + rows

    def needs_prompt_logprobs(self) -> bool:
        return self.want_prompt_logprobs or (self.echo and self.want_logprobs)

    def delta_chunk(self, update: RequestUpdate) -> JSONObject | None:
        if self.echo and self._echo_pending:  # the prompt goes out in the first chunk
            return self.chunk(self._delta_choice(update))
        return super().delta_chunk(update)

    def _delta_choice(self, update: RequestUpdate) -> JSONObject:
        text, entries = update.text, update.logprobs or ()
        if self._echo_pending and self.echo:
            self._echo_pending = False
            text, rows = self._echoed(text, entries)
        else:
            rows = [generated_row(e) for e in entries]
        return {
            "index": self.index,
            "text": text,
            "logprobs": self._logprobs(rows),
            "finish_reason": update.finish_reason,
        }

    def _full_choice(self, acc: Accumulated) -> JSONObject:
        text, rows = self._echoed(acc.text, acc.logprobs)
        choice: JSONObject = {
            "index": self.index,
            "text": text,
            "logprobs": self._logprobs(rows),
            "finish_reason": acc.finish_reason,
        }
        if self.want_prompt_logprobs:
            assert self.prompt is not None
            choice["prompt_logprobs"] = self.prompt.vllm_prompt_logprobs()
        return choice


# one token of a completion's ``logprobs`` object: (token text, logprob, top alternatives);
# the first prompt token has no logprob and no alternatives (None, None)
LogprobRow = tuple[str, float | None, dict[str, float] | None]


def generated_row(entry: LogprobEntry) -> LogprobRow:
    return entry.token, entry.logprob, {t: lp for t, _, lp in entry.top}


@dataclass
class PromptInfo:
    """One prompt of a request as its choices echo or report it (shared by its ``n`` choices).

    ``logprobs`` arrives with the first update of the prompt's leader (the choice that computes
    the prompt): one entry per prompt token, the first None.
    """

    text: str  # the prompt as the client sent it (token ids: decoded)
    token_ids: list[int]
    first_token: str  # the first token's text (its logprob entry is None)
    logprobs: tuple[LogprobEntry | None, ...] | None = None

    def ready(self) -> bool:
        return self.logprobs is not None

    def _entries(self) -> tuple[LogprobEntry | None, ...]:
        if self.logprobs is None:
            raise OpenAIError.of(
                500, "the engine returned no prompt logprobs", code="internal_error"
            )
        return self.logprobs

    def logprob_rows(self) -> list[LogprobRow]:
        """The prompt's rows of the ``logprobs`` object (vLLM: the token itself and its top
        alternatives in ``top_logprobs``; the first token null)."""
        rows: list[LogprobRow] = []
        for i, e in enumerate(self._entries()):
            if e is None:
                token = self.first_token if i == 0 else ""
                rows.append((token, None, None))
            else:
                top = {t: lp for t, _, lp in e.top}
                rows.append((e.token, e.logprob, {e.token: e.logprob, **top}))
        return rows

    def vllm_prompt_logprobs(self) -> list[JSONValue]:
        """vLLM's ``prompt_logprobs``: None, then per token ``{token_id: {logprob, rank,
        decoded_token}}`` for the token and its top alternatives (rank: 1 = most likely; the
        prompt token's rank is null when it is not among the alternatives)."""
        out: list[JSONValue] = []
        for e in self._entries():
            if e is None:
                out.append(None)
                continue
            ranks = {tid: r for r, (_, tid, _) in enumerate(e.top, start=1)}
            step: JSONObject = {
                str(e.token_id): {
                    "logprob": e.logprob, "rank": ranks.get(e.token_id), "decoded_token": e.token
                }
            }
            for rank, (text, tid, lp) in enumerate(e.top, start=1):
                step.setdefault(str(tid), {"logprob": lp, "rank": rank, "decoded_token": text})
            out.append(step)
        return out


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="surrogatepass"))


class ChatFormatter(ResponseFormatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _logprobs(self, entries: list[LogprobEntry] | tuple[LogprobEntry, ...] | None) -> Any:
        if not self.want_logprobs:
            return None
        return {
            "content": [
                {
                    "token": e.token,
                    "logprob": e.logprob,
                    "bytes": _token_bytes(e.token),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": _token_bytes(t)} for t, _, lp in e.top
                    ],
                }
                for e in entries or ()
            ],
            "refusal": None,
        }

    def full_body(self, choices: list[JSONValue], usage: Accumulated) -> JSONObject:
        body = super().full_body(choices, usage)
        if self.want_prompt_logprobs:  # (vLLM: one list per chat response, beside choices)
            assert self.prompt is not None
            body["prompt_logprobs"] = self.prompt.vllm_prompt_logprobs()
        return body

    def start_chunks(self) -> list[JSONObject]:
        choice: JSONObject = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self.chunk(choice)]

    def _delta_choice(self, update: RequestUpdate) -> JSONObject:
        delta: JSONObject = {"content": update.text} if update.text else {}
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": self._logprobs(update.logprobs) if update.logprobs else None,
            "finish_reason": update.finish_reason,
        }

    def _full_choice(self, acc: Accumulated) -> JSONObject:
        return {
            "index": self.index,
            "message": {"role": "assistant", "content": acc.text, "refusal": None},
            "logprobs": self._logprobs(acc.logprobs),
            "finish_reason": acc.finish_reason,
        }
