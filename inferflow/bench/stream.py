"""Reading one streamed OpenAI response: which chunks carry content, and when they arrived.

The timing rules are vLLM ``bench serve``'s, with "content" made explicit:

- a *content chunk* is a ``data:`` JSON object whose first choice carries non-empty text
  (``choices[0].text`` for ``/v1/completions``; ``choices[0].delta.content``, or
  ``reasoning_content``/``reasoning`` for ``/v1/chat/completions``). A chat chunk that only
  announces ``role`` or only carries ``finish_reason``, and the trailing ``usage`` chunk, are not
  content chunks;
- every chunk is stamped with the clock reading taken when the network read that completed it
  returned (all events completed by one read share that stamp, as in vLLM's client).

A stream fails when it ends in an error: an SSE ``event: error``, a ``data:`` object with an
``error`` key (vLLM/OpenAI mid-stream errors), data that is not JSON, or a stream that closes
without ``[DONE]`` and without any ``finish_reason``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from inferflow.bench.sse import SSEDecoder, SSEEvent


@dataclass
class StreamResult:
    """What one SSE stream delivered. Times are readings of the caller's clock (seconds)."""

    content_times: list[float] = field(default_factory=list)  # one stamp per content chunk
    text: str = ""
    finish_reason: str | None = None
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    done: bool = False  # saw "data: [DONE]"
    error: str = ""  # non-empty: the stream ended in an error

    @property
    def ok(self) -> bool:
        return not self.error


async def consume_stream(
    byte_chunks: AsyncIterator[bytes], clock: Callable[[], float]
) -> StreamResult:
    """Read ``byte_chunks`` to the end (or to the first error) and classify every event."""
    result = StreamResult()
    decoder = SSEDecoder()
    async for chunk in byte_chunks:
        now = clock()
        for event in decoder.feed(chunk):
            _apply_event(result, event, now)
            if result.error:
                return result
    now = clock()
    for event in decoder.flush():
        _apply_event(result, event, now)
        if result.error:
            return result
    if not result.done and result.finish_reason is None:
        result.error = "stream ended before completion (no finish_reason and no [DONE])"
    elif not result.content_times:
        result.error = "stream completed without any content chunk (no TTFT)"
    return result


def _apply_event(result: StreamResult, event: SSEEvent, now: float) -> None:
    if event.event == "error":
        result.error = f"server sent an SSE error event: {event.data[:500]}"
        return
    data = event.data.strip()
    if data == "[DONE]":
        result.done = True
        return
    try:
        payload = json.loads(data)
    except json.JSONDecodeError:
        result.error = f"malformed SSE data (not JSON): {data[:200]!r}"
        return
    if not isinstance(payload, dict):
        result.error = f"unexpected SSE data (not a JSON object): {data[:200]!r}"
        return
    if payload.get("error") is not None:
        result.error = f"server sent an error in the stream: {_error_message(payload['error'])}"
        return
    _apply_choices(result, payload.get("choices"), now)
    usage = payload.get("usage")
    if isinstance(usage, dict):
        # Servers with continuous usage stats repeat it on every chunk; the last one wins.
        if isinstance(usage.get("completion_tokens"), int):
            result.usage_completion_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            result.usage_prompt_tokens = usage["prompt_tokens"]


def _apply_choices(result: StreamResult, choices: object, now: float) -> None:
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return
    choice = choices[0]
    text = chunk_text(choice)
    if text:
        result.content_times.append(now)
        result.text += text
    if choice.get("finish_reason"):
        result.finish_reason = str(choice["finish_reason"])


def chunk_text(choice: Mapping[str, object]) -> str:
    """The generated text one streamed choice carries (completions or chat form)."""
    text = choice.get("text")
    if isinstance(text, str):
        return text
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return ""
    for key in ("content", "reasoning_content", "reasoning"):
        value = delta.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


def _error_message(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)[:500]
    return str(error)[:500]
