"""Reads tool calls out of generated text as it arrives: content text and call pieces, in order.

A :class:`CallFormat` says how a chat template's model writes calls (see
``inferflow/stages/tool_parser.py`` for the built-in formats). :class:`CallReader` is fed the
output piece by piece and returns what can be told so far, as ordered events:

- ``ContentPiece(text)``: text outside the calls. Text before a call marker is released at once;
  only a tail that may still become a marker (``"<tool_"`` of ``"<tool_call>"``) is held.
- ``CallPiece(index, id, name, arguments)``: a call's first piece has ``id`` and ``name`` (and
  ``arguments == ""``), then pieces of its arguments' JSON text follow as they are generated.

A call is an object ``{"name": ..., "arguments" | "parameters": {...}}``; its head is sent once
its ``name`` is complete and names a known tool, so a piece is never taken back: anything that
turns out not to be a call (another key, an unknown name, not JSON) is released as content,
marker included. The concatenated events do not depend on how the text was split.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

ARGUMENT_KEYS = ("arguments", "parameters")
_CALL_KEYS = frozenset(("name", *ARGUMENT_KEYS))
_SPACE = " \t\r\n"


@dataclass(frozen=True)
class CallFormat:
    """How calls appear in a model's output.

    ``opener``: the marker that opens a block of calls anywhere in the text (None: none);
    ``bare``: characters that open a block when they are the first of the output ("": never);
    ``closer``: the marker that ends a block (None: a block runs to the end of the output);
    ``separators``: what may stand between the calls of a block besides whitespace.
    """

    opener: str | None = None
    bare: str = ""
    closer: str | None = None
    separators: str = ""


@dataclass(frozen=True)
class ContentPiece:
    text: str


@dataclass(frozen=True)
class CallPiece:
    index: int  # of the call in the response (0, 1, ...)
    id: str | None  # set on the call's first piece only
    name: str | None  # set on the call's first piece only
    arguments: str  # the next piece of the arguments' JSON text


Event = ContentPiece | CallPiece


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _ObjectScan:
    """Scans one JSON object incrementally, keeping its top-level keys' raw values.

    ``raw`` is the object's text so far. Only the shape is checked (strings, nesting, the
    ``key: value`` layout at the top level); values are decoded by the reader when needed.
    """

    def __init__(self) -> None:
        self.raw = ""
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.state = "open"  # open | key | colon | value | in_value | done | failed
        self.key_start = 0
        self.key = ""
        self.value_start = -1
        self.value_end = -1  # one past the last non-space character of the current value
        self.values: dict[str, str] = {}

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    def current(self, key: str) -> str | None:
        """The raw text of ``key``'s value so far (complete or not), None if not begun."""
        if key in self.values:
            return self.values[key]
        if self.state == "in_value" and self.key == key:
            return self.raw[self.value_start : self.value_end]
        return None

    def feed(self, text: str) -> int:
        """Consume ``text`` up to the object's end; returns how many characters were used."""
        for i, ch in enumerate(text):
            pos = len(self.raw)
            self.raw += ch
            self._step(ch, pos)
            if self.state in ("done", "failed"):
                return i + 1
        return len(text)

    def _step(self, ch: str, pos: int) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.state == "key":
                    try:
                        self.key = json.loads(self.raw[self.key_start : pos + 1])
                    except ValueError:
                        self.state = "failed"
                        return
                    self.state = "colon" if self.key in _CALL_KEYS else "failed"
            if self.state == "in_value":
                self.value_end = pos + 1
            return
        if ch in _SPACE:
            return
        state = self.state
        if state == "open":
            self.state, self.depth = ("key", 1) if ch == "{" else ("failed", 0)
        elif state == "key":
            if ch == '"':
                self.in_str, self.key_start = True, pos
            else:
                self.state = "done" if ch == "}" and not self.values else "failed"
        elif state == "colon":
            self.state = "value" if ch == ":" else "failed"
        elif state in ("value", "in_value"):
            if state == "value":
                if ch in ",}]:":
                    self.state = "failed"
                    return
                self.state, self.value_start = "in_value", pos
            if self.depth == 1 and ch in ",}":
                self.values[self.key] = self.raw[self.value_start : self.value_end]
                if ch == ",":
                    self.state = "key"
                else:
                    self.state, self.depth = "done", 0
                return
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
            self.value_end = pos + 1


@dataclass
class _Call:
    index: int
    id: str = field(default_factory=new_call_id)
    name: str | None = None  # once its head is sent
    arguments: str = ""  # sent so far
    complete: bool = False


class CallReader:
    """Incremental reader of one response's calls (see the module docstring).

    ``names``: the tools the request offered (a call naming another is content).
    """

    def __init__(self, fmt: CallFormat, names: set[str] | frozenset[str]) -> None:
        self.fmt = fmt
        self.names = frozenset(names)
        self.calls: list[_Call] = []
        self._pending = ""  # received, not yet read
        self._in_block = False
        self._at_start = True  # nothing but whitespace read yet
        self._block_raw = ""  # block text read since the last call (released if no call follows)
        self._scan: _ObjectScan | None = None
        self._call: _Call | None = None  # the call being read, once its head is sent
        self._events: list[Event] = []

    # --- public -------------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self._pending += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The rest, at the end of the output (held text is released)."""
        self._run(final=True)
        if self._scan is not None and self._call is None:  # an object that never became a call
            self._fail()
        elif self._in_block and self._call is None:
            self._content(self._block_raw if not self.calls else "")
            self._block_raw = ""
        return self._take()

    @property
    def complete_calls(self) -> list[_Call]:
        return [c for c in self.calls if c.complete]

    @property
    def incomplete(self) -> bool:
        """A call was begun (its head sent) and not finished."""
        return any(not c.complete for c in self.calls)

    # --- reading ------------------------------------------------------------------------------
    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        if not text:
            return
        last = self._events[-1] if self._events else None
        if isinstance(last, ContentPiece):
            self._events[-1] = ContentPiece(last.text + text)
        else:
            self._events.append(ContentPiece(text))

    def _run(self, final: bool) -> None:
        while self._pending:
            progressed = self._block_step(final) if self._in_block else self._text_step(final)
            if not progressed:
                return

    def _text_step(self, final: bool) -> bool:
        fmt, text = self.fmt, self._pending
        if self._at_start:
            stripped = text.lstrip(_SPACE)
            if not final and (not stripped or (fmt.opener or "").startswith(stripped)):
                return False  # only whitespace (or the opener's start) so far
            opens = fmt.opener is not None and stripped.startswith(fmt.opener)
            if stripped and stripped[0] in fmt.bare and not opens:
                self._open_block(text[: len(text) - len(stripped)], stripped)
                return True
            self._at_start = False
        if self.calls and not text.strip(_SPACE):
            if final:
                self._pending = ""  # whitespace after the calls: dropped
            return False
        if fmt.opener is None:
            self._content(text)
            self._pending = ""
            return False
        at = text.find(fmt.opener)
        if at >= 0:
            if not (self.calls and not text[:at].strip(_SPACE)):  # (not the space between calls)
                self._content(text[:at])
            self._open_block(fmt.opener, text[at + len(fmt.opener) :])
            return True
        keep = 0 if final else partial_suffix(text, fmt.opener)
        if self.calls and not final and not text[: len(text) - keep].strip(_SPACE):
            return False  # space after a call, maybe before the next one
        self._content(text[: len(text) - keep])
        self._pending = text[len(text) - keep :]
        return False

    def _open_block(self, consumed: str, rest: str) -> None:
        self._in_block, self._at_start = True, False
        self._block_raw, self._pending = consumed, rest

    def _block_step(self, final: bool) -> bool:
        fmt = self.fmt
        if self._scan is None:
            text = self._pending
            skipped = len(text) - len(text.lstrip(_SPACE + fmt.separators))
            self._block_raw += text[:skipped]
            text = self._pending = text[skipped:]
            if not text:
                return False
            if fmt.closer is not None:
                if text.startswith(fmt.closer):
                    self._pending = text[len(fmt.closer) :]
                    self._in_block = False
                    if not self.calls or self._block_raw.strip(_SPACE + fmt.separators):
                        self._content(self._block_raw + fmt.closer)  # a block without a call
                    self._block_raw = ""
                    return True
                if fmt.closer.startswith(text) and not final:
                    return False
            if text[0] != "{":
                self._fail()
                return True
            self._scan = _ObjectScan()
        scan = self._scan
        used = scan.feed(self._pending)
        self._pending = self._pending[used:]
        self._follow(scan)
        return scan.done or scan.failed or self._scan is None

    def _follow(self, scan: _ObjectScan) -> None:
        """Send what the scan tells about the current call: its head, then argument pieces."""
        if scan.failed:
            self._fail()
            return
        call = self._call
        if call is None:
            raw_name = scan.values.get("name")
            if raw_name is None:
                if scan.done:
                    self._fail()
                return
            try:
                name = json.loads(raw_name)
            except ValueError:
                name = None
            if not isinstance(name, str) or name not in self.names:
                self._fail()
                return
            call = self._call = _Call(len(self.calls), name=name)
            self.calls.append(call)
            self._events.append(CallPiece(call.index, call.id, name, ""))
        key = next((k for k in ARGUMENT_KEYS if scan.current(k) is not None), None)
        arguments = scan.current(key) if key is not None else None
        if arguments is not None and not arguments.startswith('"'):  # (a string: sent whole)
            self._send_arguments(call, arguments)
        if scan.done:
            if arguments is None:
                arguments = "{}"
            elif arguments.startswith('"'):
                try:
                    decoded = json.loads(arguments)
                except ValueError:
                    decoded = arguments
                arguments = decoded if isinstance(decoded, str) else arguments
            self._send_arguments(call, arguments)
            call.complete = True
            self._call = self._scan = None
            self._block_raw = ""

    def _send_arguments(self, call: _Call, arguments: str) -> None:
        if len(arguments) > len(call.arguments) and arguments.startswith(call.arguments):
            self._events.append(CallPiece(call.index, None, None, arguments[len(call.arguments) :]))
            call.arguments = arguments

    def _fail(self) -> None:
        """What the block holds is not a call: it is content, and reading goes on as text."""
        raw = self._scan.raw if self._scan is not None and self._call is None else ""
        self._content(self._block_raw + raw + self._pending)
        self._pending = ""
        self._block_raw, self._scan, self._call, self._in_block = "", None, None, False
        self._at_start = False


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def read_calls(
    fmt: CallFormat, names: set[str] | frozenset[str], text: str
) -> tuple[str | None, list[dict[str, Any]], bool]:
    """The whole output at once: (content or None, OpenAI ``tool_calls``, a call left
    incomplete)."""
    reader = CallReader(fmt, names)
    events = reader.feed(text) + reader.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentPiece))
    calls = [
        {
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in reader.complete_calls
    ]
    return (content if content.strip() else None) if calls else content, calls, reader.incomplete
