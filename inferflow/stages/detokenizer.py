"""The ``detokenizer`` slot: incremental, UTF-8-safe detokenization of generated tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from inferflow.stages.engine_slot import EngineSlot, EngineSpec


@dataclass
class IncrementalDetokenizer(EngineSlot):
    """Turn generated ids into text deltas as they arrive (stop strings are matched on the text).

    ``stream_interval``: tokens coalesced per streamed message (1 = every token); the frontend
    reads it from ``ServingGraph.engine_slots["detokenizer"]``.
    """

    kind: ClassVar[str] = "detokenizer"
    skip_special_tokens: bool = True
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval: must be >= 1, got {self.stream_interval}")

    def contribute(self, spec: EngineSpec) -> None:
        spec.detokenizer["skip_special_tokens"] = self.skip_special_tokens
