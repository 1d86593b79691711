"""The ``batching`` slot: how waiting requests are grouped into engine steps.

=============  =====================================================================
``none``       one request at a time (the null implementation)
``static``     form a batch from the waiting requests, run it to completion, repeat
``dynamic``    ``static`` for generation; for one-shot models (embeddings) a batching
               window of ``max_delay_ms`` groups requests that arrive close together
``continuous`` requests join and leave the running batch every step (chunked prefill)
=============  =====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from inferflow.stages.base import ConfigEnum
from inferflow.stages.engine_slot import EngineSlot, EngineSpec


class SchedulingPolicy(ConfigEnum):
    """Order of the waiting queue: arrival order, or ``priority`` (lower value first)."""

    fcfs = "fcfs"
    priority = "priority"


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}: must be >= 1, got {value}")


@dataclass
class NoBatching(EngineSlot):
    """One request at a time: the null batching policy."""

    kind: ClassVar[str] = "batching"
    max_num_batched_tokens: int = 512
    policy: SchedulingPolicy = SchedulingPolicy.fcfs

    mode: ClassVar[str] = "none"

    def __post_init__(self) -> None:
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)

    @property
    def max_num_seqs(self) -> int:
        return 1

    def contribute(self, spec: EngineSpec) -> None:
        spec.scheduler.update(
            mode=self.mode,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            policy=SchedulingPolicy(self.policy).value,
        )


@dataclass
class StaticBatching(NoBatching):
    """Batches of up to ``max_batch_size`` requests, each run to completion."""

    max_batch_size: int = 8
    max_num_batched_tokens: int = 2048
    mode: ClassVar[str] = "static"

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("max_batch_size", self.max_batch_size)

    @property
    def max_num_seqs(self) -> int:
        return self.max_batch_size


@dataclass
class DynamicBatching(StaticBatching):
    """``static`` for generation, plus a batching window for one-shot (embedding) models."""

    max_delay_ms: float = 2.0
    max_queue_size: int = 1024
    bucket_boundaries: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512])

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.max_delay_ms <= 10.0:
            raise ValueError(f"max_delay_ms: must be in [0, 10], got {self.max_delay_ms}")
        _positive("max_queue_size", self.max_queue_size)

    def dynamic_batching_config(self) -> Any:
        """The embedding path's ``DynamicBatchingConfig`` with these settings."""
        from inferflow.scheduling.dynamic_batcher import DynamicBatchingConfig

        return DynamicBatchingConfig(
            max_batch_size=self.max_batch_size,
            max_delay_ms=self.max_delay_ms,
            max_queue_size=self.max_queue_size,
            bucket_boundaries=tuple(self.bucket_boundaries),
        )


@dataclass
class ContinuousBatching(StaticBatching):
    """Requests join and leave the running batch every step (vLLM-style).

    ``max_num_batched_tokens`` is the per-step token budget; with ``enable_chunked_prefill`` a
    long prompt is prefilled over several steps, at most ``long_prefill_token_threshold`` tokens
    per step (0 = no cap) so decodes keep flowing.
    """

    max_batch_size: int = 16
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    mode: ClassVar[str] = "continuous"

    def contribute(self, spec: EngineSpec) -> None:
        super().contribute(spec)
        spec.scheduler.update(
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )
