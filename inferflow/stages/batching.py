"""The ``batching`` slot: the scheduling policy, i.e. how waiting requests become engine steps.

=============  =====================================================================
``none``       one request at a time (the null implementation)
``static``     form a batch from the waiting requests, run it to completion, repeat
``dynamic``    ``static`` for generation; for one-shot models (embeddings) a batching
               window of ``max_delay_ms`` groups requests that arrive close together
``continuous`` requests join and leave the running batch every step (chunked prefill)
=============  =====================================================================

A :class:`BatchingStage` gives the scheduler its budgets (:meth:`~BatchingStage.scheduler_config`)
and *is* its :class:`~inferflow.scheduling.policy.SchedulingPolicy`: override
:meth:`~BatchingStage.sort_key` to change the order in which queued requests are admitted (and,
reversed, preempted) without forking the scheduler.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from inferflow.config.base import ConfigEnum
from inferflow.scheduling.config import BatchingMode
from inferflow.stages.engine_slot import EngineStage

if TYPE_CHECKING:
    from inferflow.embeddings.dynamic_batcher import DynamicBatchingConfig
    from inferflow.scheduling.config import SchedulerConfig
    from inferflow.scheduling.layout import KVLayout
    from inferflow.scheduling.policy import RequestQueue, SortKey
    from inferflow.scheduling.request import Request


class SchedulingPolicy(ConfigEnum):
    """The built-in orders of the waiting queue: arrival, or ``priority`` (lower value first)."""

    fcfs = "fcfs"
    priority = "priority"


_MODES: dict[str, BatchingMode] = {"continuous": "continuous", "static": "static", "none": "none"}


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}: must be >= 1, got {value}")


@dataclass
class BatchingStage(EngineStage):
    """Contract of the ``batching`` slot.

    - ``max_num_seqs``: requests running at once (vLLM's name; ``max_batch_size`` is the old
      spelling, still accepted with a warning); ``max_num_batched_tokens``: tokens per step.
    - :meth:`scheduler_config` turns the fields plus the engine's frozen
      :class:`~inferflow.scheduling.layout.KVLayout` into the scheduler's config; it is called
      once, in the engine worker.
    - :meth:`sort_key` / :meth:`make_queue`: the scheduling policy. ``sort_key`` is computed once
      per request when it is queued; smaller keys are admitted first and preempted last. It must
      be a pure function of the request (prompt, params, priority, arrival) and ``seq``.
    """

    kind: ClassVar[str] = "batching"
    mode: ClassVar[str] = "continuous"
    max_num_seqs: int = 64  # every client of a c64 load runs at once (slots are cheap on CPU)
    max_num_batched_tokens: int = 2048  # a prefill burst in few steps (docs/performance.md)
    policy: SchedulingPolicy = SchedulingPolicy.fcfs
    # the deprecated spelling of max_num_seqs (task=check leaves out a renamed_to field)
    max_batch_size: int | None = field(default=None, metadata={"renamed_to": "max_num_seqs"})

    def __post_init__(self) -> None:
        if self.max_batch_size is not None:
            warnings.warn(
                "batching.max_batch_size is deprecated: use batching.max_num_seqs",
                FutureWarning,
                stacklevel=3,
            )
            self.max_num_seqs, self.max_batch_size = self.max_batch_size, None
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)

    def scheduler_config(self, layout: KVLayout, enable_prefix_caching: bool) -> SchedulerConfig:
        from inferflow.scheduling.config import SchedulerConfig

        chunked, threshold = self._chunking()
        return SchedulerConfig.for_layout(
            layout,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=chunked,
            long_prefill_token_threshold=threshold,
            policy="priority" if self.policy == SchedulingPolicy.priority else "fcfs",
            mode=_MODES[self.mode],
        )

    def _chunking(self) -> tuple[bool, int]:
        """(enable_chunked_prefill, long_prefill_token_threshold)."""
        return True, 0

    # -- the scheduling policy ------------------------------------------------------------------
    def sort_key(self, request: Request, seq: int) -> SortKey:
        if SchedulingPolicy(self.policy) is SchedulingPolicy.priority:
            return (request.priority, request.arrival_time, seq)
        return (seq,)

    def make_queue(self, keys: dict[str, SortKey]) -> RequestQueue:
        from inferflow.scheduling.policy import FCFSQueue, SortedQueue

        if type(self).sort_key is BatchingStage.sort_key and self.policy == SchedulingPolicy.fcfs:
            return FCFSQueue()  # arrival order: a deque is enough
        return SortedQueue(keys)


@dataclass
class NoBatching(BatchingStage):
    """One request at a time: the null batching policy (``max_num_seqs`` is always 1)."""

    mode: ClassVar[str] = "none"
    max_num_seqs: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_num_seqs != 1:
            raise ValueError(
                f"max_num_seqs: batching=none runs one request, got {self.max_num_seqs}"
            )


@dataclass
class StaticBatching(BatchingStage):
    """Batches of up to ``max_num_seqs`` requests, each run to completion."""

    mode: ClassVar[str] = "static"
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 2048


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

    def dynamic_batching_config(self) -> DynamicBatchingConfig:
        """The embedding path's ``DynamicBatchingConfig`` with these settings."""
        from inferflow.embeddings.dynamic_batcher import DynamicBatchingConfig

        return DynamicBatchingConfig(
            max_batch_size=self.max_num_seqs,
            max_delay_ms=self.max_delay_ms,
            max_queue_size=self.max_queue_size,
            bucket_boundaries=tuple(self.bucket_boundaries),
        )


@dataclass
class ContinuousBatching(BatchingStage):
    """Requests join and leave the running batch every step (vLLM-style).

    ``max_num_batched_tokens`` is the per-step token budget; with ``enable_chunked_prefill`` a
    long prompt is prefilled over several steps, at most ``long_prefill_token_threshold`` tokens
    per step (0 = no cap) so decodes keep flowing.
    """

    mode: ClassVar[str] = "continuous"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0

    def _chunking(self) -> tuple[bool, int]:
        return self.enable_chunked_prefill, self.long_prefill_token_threshold
