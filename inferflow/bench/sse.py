"""Incremental Server-Sent Events decoder (WHATWG HTML "event stream" rules).

Bytes arrive in arbitrary pieces (TCP reads); ``SSEDecoder.feed`` returns every event completed by
the new bytes, ``flush`` the one left pending when the stream ends without a final blank line.
Lines end in ``\\n``, ``\\r\\n`` or ``\\r``; a blank line dispatches the event; lines starting with
``:`` are comments (keep-alive pings); ``data`` lines of one event are joined with ``\\n``.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event. ``event`` is ``"message"`` unless the server named it."""

    data: str
    event: str = "message"


class SSEDecoder:
    """Turns a byte stream into :class:`SSEEvent` objects, one ``feed`` at a time."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # text not yet terminated by a line ending
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Decode ``chunk`` and return the events it completes (possibly none)."""
        self._pending += self._utf8.decode(chunk)
        return self._drain_lines(final=False)

    def flush(self) -> list[SSEEvent]:
        """End of stream: process the last unterminated line and dispatch a pending event.

        Servers that close the stream right after ``data: [DONE]`` without a blank line still
        deliver that event (vLLM's client tolerates the same)."""
        self._pending += self._utf8.decode(b"", final=True)
        events = self._drain_lines(final=True)
        if self._pending:
            self._process_line(self._pending)
            self._pending = ""
        event = self._dispatch()
        return [*events, event] if event is not None else events

    def _drain_lines(self, final: bool) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        text = self._pending
        start = 0
        while True:
            cut = _next_line_end(text, start)
            if cut is None:
                break
            end, after = cut
            # A trailing "\r" may be the first half of "\r\n": wait for more bytes unless final.
            if after == len(text) and text[end] == "\r" and not final:
                break
            line = text[start:end]
            start = after
            if line == "":
                event = self._dispatch()
                if event is not None:
                    events.append(event)
            else:
                self._process_line(line)
        self._pending = text[start:]
        return events

    def _process_line(self, line: str) -> None:
        if line.startswith(":"):
            return  # comment / keep-alive
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        # "id" and "retry" do not matter to a benchmark client; unknown fields are ignored.

    def _dispatch(self) -> SSEEvent | None:
        """The event so far (None without data lines: an ``event:`` alone dispatches nothing);
        either way the next one starts empty."""
        event = SSEEvent("\n".join(self._data), self._event or "message") if self._data else None
        self._data, self._event = [], ""
        return event


def _next_line_end(text: str, start: int) -> tuple[int, int] | None:
    """Index of the next line terminator at or after ``start`` and the index just past it."""
    n = text.find("\n", start)
    r = text.find("\r", start)
    if n < 0 and r < 0:
        return None
    if r < 0 or (0 <= n < r):
        return n, n + 1
    if r + 1 < len(text) and text[r + 1] == "\n":
        return r, r + 2
    return r, r + 1
