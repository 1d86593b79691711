"""Splits generated text into reasoning and answer as it arrives (``<think>...</think>``).

:class:`ThinkReader` is fed the output piece by piece and returns ``("reasoning", text)`` and
``("content", text)`` pieces in order. The reasoning is what stands between the opening and the
closing marker; a template that opens the marker in the prompt (Qwen3 / DeepSeek-R1 style:
the generation prompt ends with ``<think>``) starts the reader inside the reasoning, so only
the closing marker appears in the output. Only a tail that may still become a marker is held;
whitespace between the closing marker and the answer is dropped. An output that does not open
with the marker (and was not opened by the prompt) is all content.
"""

from __future__ import annotations

from typing import Literal

from inferflow.stages.call_reader import partial_suffix

Channel = Literal["reasoning", "content"]
_SPACE = " \t\r\n"


class ThinkReader:
    def __init__(self, start: str = "<think>", end: str = "</think>", inside: bool = False):
        self.start, self.end = start, end
        self.state: Literal["open", "reasoning", "answer_start", "content"] = (
            "reasoning" if inside else "open"
        )
        self.reasoned = inside  # the output has (had) a reasoning part
        self._pending = ""
        self._out: list[tuple[Channel, str]] = []

    def feed(self, text: str) -> list[tuple[Channel, str]]:
        self._pending += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[tuple[Channel, str]]:
        self._run(final=True)
        return self._take()

    def _take(self) -> list[tuple[Channel, str]]:
        out, self._out = self._out, []
        return out

    def _emit(self, channel: Channel, text: str) -> None:
        if not text:
            return
        if self._out and self._out[-1][0] == channel:
            self._out[-1] = (channel, self._out[-1][1] + text)
        else:
            self._out.append((channel, text))

    def _run(self, final: bool) -> None:
        while self._pending:
            text = self._pending
            if self.state == "open":
                stripped = text.lstrip(_SPACE)
                if not final and self.start.startswith(stripped):
                    return  # whitespace or the marker's start so far
                if stripped.startswith(self.start):
                    self.state, self._pending = "reasoning", stripped[len(self.start) :]
                    self.reasoned = True
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                at = text.find(self.end)
                if at >= 0:
                    self._emit("reasoning", text[:at])
                    self.state, self._pending = "answer_start", text[at + len(self.end) :]
                    continue
                keep = 0 if final else partial_suffix(text, self.end)
                self._emit("reasoning", text[: len(text) - keep])
                self._pending = text[len(text) - keep :]
                return
            elif self.state == "answer_start":
                stripped = text.lstrip(_SPACE)
                self._pending = stripped
                if stripped:
                    self.state = "content"
                else:
                    return
            else:
                self._emit("content", text)
                self._pending = ""


def split_reasoning(reader: ThinkReader, text: str) -> tuple[str | None, str]:
    """The whole output at once: (reasoning or None, content)."""
    pieces = reader.feed(text) + reader.finish()
    reasoning = "".join(t for c, t in pieces if c == "reasoning")
    content = "".join(t for c, t in pieces if c == "content")
    return (reasoning if reader.reasoned else None), content
