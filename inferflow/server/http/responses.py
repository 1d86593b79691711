"""OpenAI response objects: whole completions and streamed chunks, for both endpoints.

One ``ResponseFormatter`` serves one request, so every chunk of a completion carries the same
``id`` and ``created``. Streams follow OpenAI's order: (chat: a role chunk,) content chunks, the
last content chunk carrying ``finish_reason``, then — with ``stream_options.include_usage`` — a
chunk with empty ``choices`` and the ``usage``; every other chunk has ``"usage": null`` then.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from inferflow.json_types import JSONObject, JSONValue
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

    def add(self, update: RequestUpdate) -> None:
        self.text += update.text
        self.logprobs.extend(update.logprobs or ())
        self.finish_reason = update.finish_reason or self.finish_reason
        self.prompt_tokens = update.prompt_tokens or self.prompt_tokens
        self.completion_tokens = update.completion_tokens
        self.cached_tokens = update.cached_tokens
        self.timings = update.timings or self.timings

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

    def __init__(self, model: str, include_usage: bool, want_logprobs: bool) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs

    def _envelope(self, object_name: str, choices: list[JSONValue]) -> JSONObject:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }

    def chunk(self, choice: JSONObject) -> JSONObject:
        body = self._envelope(self.chunk_object_name, [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, acc: Accumulated) -> JSONObject:
        body = self._envelope(self.chunk_object_name, [])
        body["usage"] = acc.usage()
        return body

    def full(self, acc: Accumulated) -> JSONObject:
        body = self._envelope(self.object_name, [self._full_choice(acc)])
        body["usage"] = acc.usage()
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

    def _logprobs(self, entries: list[LogprobEntry] | tuple[LogprobEntry, ...] | None) -> Any:
        if not self.want_logprobs:
            return None
        entries = entries or ()
        offsets = []
        for e in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: lp for t, _, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _delta_choice(self, update: RequestUpdate) -> JSONObject:
        return {
            "index": 0,
            "text": update.text,
            "logprobs": self._logprobs(update.logprobs),
            "finish_reason": update.finish_reason,
        }

    def _full_choice(self, acc: Accumulated) -> JSONObject:
        return {
            "index": 0,
            "text": acc.text,
            "logprobs": self._logprobs(acc.logprobs),
            "finish_reason": acc.finish_reason,
        }


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

    def start_chunks(self) -> list[JSONObject]:
        choice: JSONObject = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self.chunk(choice)]

    def _delta_choice(self, update: RequestUpdate) -> JSONObject:
        delta: JSONObject = {"content": update.text} if update.text else {}
        return {
            "index": 0,
            "delta": delta,
            "logprobs": self._logprobs(update.logprobs) if update.logprobs else None,
            "finish_reason": update.finish_reason,
        }

    def _full_choice(self, acc: Accumulated) -> JSONObject:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": acc.text, "refusal": None},
            "logprobs": self._logprobs(acc.logprobs),
            "finish_reason": acc.finish_reason,
        }
