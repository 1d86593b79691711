"""The ``detokenizer`` slot: generated token ids -> text deltas, with stop strings.

:class:`StreamingDetokenizer` (``detokenizer=default``) gives each request a
:class:`TextDetokenizer`. Text is released only when it is final: never half of a multi-byte
character (the decoder's U+FFFD replacement at the end of a window means "wait for more bytes"),
and never a tail that could still become a stop string. A matched stop string and everything
after it are cut from the text.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from inferflow.stages.engine_slot import EngineStage

if TYPE_CHECKING:
    from inferflow.sampling_params import SamplingParams


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

    Only the last ``len(stop) - 1`` characters can start a partial match, and only where
    ``stop[0]`` occurs: those candidates are checked longest first (``str.find`` and
    ``str.startswith`` do the scanning), so a step costs about the length of the stops, not
    the length of the output.
    """
    best = 0
    for stop in stops:
        tail = text[len(text) - min(len(stop) - 1, len(text)) :]
        start = tail.find(stop[0]) if tail else -1
        while start != -1 and len(tail) - start > best:
            if stop.startswith(tail[start:]):
                best = len(tail) - start
                break
            start = tail.find(stop[0], start + 1)
    return best


class TextDetokenizer:
    """Turns a request's output tokens into text deltas, one step at a time."""

    def __init__(self, tokenizer: Decoder, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # decode window start (tokens before it are final text)
        self._read_offset = 0  # tokens up to here have been turned into text
        self.text = ""  # decoded text so far (may include a held-back tail)
        self._emitted = 0  # characters of ``text`` already released
        self.stop_reason: str | None = None

    def _decode_new(self, force: bool = False) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = decode(self.token_ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) > len(prefix) and (force or not full.endswith("\ufffd")):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            return full[len(prefix):]
        return ""

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Append tokens; return the text now safe to release. ``final`` flushes held-back text.

        After a stop string matches, ``stop_reason`` is set and further tokens are ignored.
        """
        if self.stop_reason is not None:
            return ""
        self.token_ids.extend(new_ids)
        before = len(self.text)
        self.text += self._decode_new(force=final)
        if self.stop:
            # a stop string can only end inside the new text: search from where it could start
            start = max(0, before - max(len(s) for s in self.stop) + 1)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                idx, self.stop_reason = min(hits)
                self.text = self.text[:idx]
                final = True
        release = len(self.text) if final else len(self.text) - partial_stop_len(self.text, self.stop)
        delta = self.text[self._emitted:release]
        self._emitted = max(self._emitted, release)
        return delta

    @property
    def output_text(self) -> str:
        """The text released so far."""
        return self.text[:self._emitted]


class RequestDetokenizer(Protocol):
    """One request's detokenization state (:class:`TextDetokenizer` is the built-in one)."""

    stop_reason: str | None  # the stop string that matched, once one has

    def add(self, new_ids: Sequence[int], final: bool = False) -> str:
        """Append tokens; return the text now safe to release (``final`` flushes the rest)."""
        ...

    @property
    def output_text(self) -> str:
        """All text released so far."""
        ...


@dataclass
class DetokenizerStage(EngineStage):
    """Contract of the ``detokenizer`` slot.

    - :meth:`start` is called once per request (engine thread) and returns its
      :class:`RequestDetokenizer`; the engine feeds it every sampled token and ends the request
      when ``stop_reason`` becomes set (a stop string matched: its text is cut).
    - ``stream_interval``: the engine emits a request's output every ``stream_interval`` tokens
      (and always its last one), so a streaming client gets fewer, larger deltas (vLLM's knob).
    """

    kind: ClassVar[str] = "detokenizer"
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval: must be >= 1, got {self.stream_interval}")

    @abstractmethod
    def start(self, tokenizer: Decoder, params: SamplingParams) -> RequestDetokenizer:
        """The detokenization state of one new request."""


@dataclass
class StreamingDetokenizer(DetokenizerStage):
    """Incremental, UTF-8-safe detokenization; ``skip_special_tokens`` drops e.g. ``</s>``."""

    skip_special_tokens: bool = True

    def start(self, tokenizer: Decoder, params: SamplingParams) -> RequestDetokenizer:
        return TextDetokenizer(tokenizer, params.stop, self.skip_special_tokens)


def __getattr__(name: str) -> Any:
    if name == "IncrementalDetokenizer":  # the slot class's name before 0.2
        import warnings

        warnings.warn(
            "inferflow.stages.detokenizer.IncrementalDetokenizer is now StreamingDetokenizer",
            FutureWarning,
            stacklevel=2,
        )
        return StreamingDetokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
