"""The ``detokenizer`` slot: generated token ids -> text deltas, with stop strings.

:class:`StreamingDetokenizer` (``detokenizer=default``) releases UTF-8-safe text as tokens
arrive and matches stop strings on the text (``inferflow.sampling.detokenizer``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from inferflow.stages.engine_slot import EngineStage

if TYPE_CHECKING:
    from inferflow.sampling.detokenizer import Decoder
    from inferflow.sampling_params import SamplingParams


class RequestDetokenizer(Protocol):
    """One request's detokenization state (``inferflow.sampling.detokenizer.IncrementalDetokenizer``
    is the built-in one)."""

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
        from inferflow.sampling.detokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(tokenizer, params.stop, self.skip_special_tokens)


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
