"""The ``batching`` slot: the scheduling policy, i.e. how waiting requests become engine steps.

=============  =====================================================================
``none``       one request at a time (the null implementation)
``static``     form a batch from the waiting requests, run it to completion, repeat
``dynamic``    ``static`` for generation; for one-shot models (embeddings) a batching
               window of ``max_delay_ms`` groups requests that arrive close together
``continuous`` requests join and leave the running batch every step (chunked prefill)
=============  =====================================================================

A :class:`BatchingStage` *is* the scheduler's budgets (:class:`~inferflow.scheduling.config.Budgets`)
and its :class:`~inferflow.scheduling.policy.AdmissionOrder`: override
:meth:`~BatchingStage.sort_key` to change the order in which queued requests are admitted (and,
reversed, preempted) without forking the scheduler.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from inferflow.config.base import ConfigEnum
from inferflow.config.tunable import tunable
from inferflow.stages.engine_slot import EngineStage

if TYPE_CHECKING:
    from inferflow.scheduling.policy import RequestQueue, SortKey
    from inferflow.scheduling.request import Request


class SchedulingPolicy(ConfigEnum):
    """The built-in orders of the waiting queue: arrival, or ``priority`` (lower value first)."""

    fcfs = "fcfs"
    priority = "priority"


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}: must be >= 1, got {value}")


@dataclass
class BatchingStage(EngineStage):
    """Contract of the ``batching`` slot.

    - ``max_num_seqs``: requests running at once (vLLM's name; ``max_batch_size`` is the old
      spelling, still accepted with a warning); ``max_num_batched_tokens``: tokens per step.
    - the stage is the scheduler's budgets as it is (``Scheduler(batching, layout, ...)``, in the
      engine worker); ``mode`` and the chunked-prefill switches are read-only here and fields of
      ``ContinuousBatching``.
    - :meth:`sort_key` / :meth:`make_queue`: the scheduling policy. ``sort_key`` is computed once
      per request when it is queued; smaller keys are admitted first and preempted last. It must
      be a pure function of the request (prompt, params, priority, arrival) and ``seq``.
    """

    kind: ClassVar[str] = "batching"
    mode: ClassVar[str] = "continuous"
    # every client of a c64 load runs at once (slots are cheap on CPU)
    max_num_seqs: int = tunable(64, low=1, high=256, log=True,
                                note="rows per step: throughput vs time per output token")
    # a prefill burst in few steps (docs/performance.md)
    max_num_batched_tokens: int = tunable(2048, low=64, high=8192, log=True,
                                          note="tokens per step: prefill speed vs decode stalls")
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

    @property
    def enable_chunked_prefill(self) -> bool:
        return True

    @property
    def long_prefill_token_threshold(self) -> int:
        return 0

    # -- the scheduling policy ------------------------------------------------------------------
    @property
    def honours_priority(self) -> bool:
        """Whether the order reads ``Request.priority``: the ``priority`` policy does, ``fcfs``
        does not (a non-default priority is refused, ``scheduling/priority.py``); a plugin's own
        ``sort_key`` is trusted to."""
        own_order = type(self).sort_key is not BatchingStage.sort_key
        return own_order or SchedulingPolicy(self.policy) is SchedulingPolicy.priority

    def sort_key(self, request: Request, seq: int) -> SortKey:
        from inferflow.scheduling.policy import sort_key

        return sort_key(SchedulingPolicy(self.policy).value, request, seq)

    def make_queue(self, keys: dict[str, SortKey]) -> RequestQueue:
        from inferflow.scheduling.policy import SortedQueue, make_queue

        if type(self).sort_key is not BatchingStage.sort_key:
            return SortedQueue(keys)  # a plugin's order
        return make_queue(SchedulingPolicy(self.policy).value, keys)


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
    """``static`` for generation, plus a batching window for one-shot (embedding) models: the
    embeddings' ``DynamicBatcher`` takes this stage as its settings (``max_num_seqs`` items per
    engine call, ``max_delay_ms`` window, ``max_queue_size``, length ``bucket_boundaries``)."""

    max_delay_ms: float = 2.0
    max_queue_size: int = 1024
    bucket_boundaries: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512])

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.max_delay_ms <= 10.0:
            raise ValueError(f"max_delay_ms: must be in [0, 10], got {self.max_delay_ms}")
        _positive("max_queue_size", self.max_queue_size)
        if list(self.bucket_boundaries) != sorted(set(self.bucket_boundaries)):
            raise ValueError(
                f"bucket_boundaries: must be strictly increasing, got {self.bucket_boundaries}"
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
    long_prefill_token_threshold: int = tunable(
        0, choices=(0, 64, 128, 256, 512),
        note="one prompt's tokens per step (0: no cap): decodes keep flowing beside long prompts")
