"""The scheduler's budgets (what it may run per step) and the rules that check them.

The physical sizes are not here: they are the frozen :class:`~inferflow.scheduling.layout.KVLayout`
the scheduler is given beside its budgets. On the server the ``batching`` stage *is* the budgets
and the admission order (``stages/batching.py``); :class:`SchedulerConfig` is the same thing as
plain values, for offline tools and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from inferflow.scheduling.layout import KVLayout, window_blocks
from inferflow.scheduling.policy import AdmissionOrder, RequestQueue, SortKey, make_queue, sort_key
from inferflow.scheduling.request import Request, max_kv_tokens

BatchingMode = Literal["continuous", "static", "none"]


class SchedulerConfigError(ValueError):
    """An invalid scheduler setting; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class Budgets(AdmissionOrder, Protocol):
    """What the scheduler reads of its budgets (the ``batching`` stage, or a SchedulerConfig).

    - ``max_num_seqs``: running requests at once (also bounded by the layout's slots);
    - ``max_num_batched_tokens``: tokens computed per step (decode rows count 1 each);
    - ``enable_chunked_prefill``: a long prompt may take several steps;
      ``long_prefill_token_threshold`` caps one request's chunk per step (0 = none);
    - ``mode``: ``continuous`` (admit whenever there is room), ``static`` (form a batch, run it to
      completion, then form the next) or ``none`` (one request at a time);
    - ``policy``: the name of the admission order (``fcfs``, ``priority``), for reports.
    """

    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def enable_chunked_prefill(self) -> bool: ...
    @property
    def long_prefill_token_threshold(self) -> int: ...
    @property
    def mode(self) -> str: ...
    @property
    def policy(self) -> str: ...


@dataclass(frozen=True)
class SchedulerConfig:
    """:class:`Budgets` as plain values; ``policy`` names the admission order (``fcfs``: arrival;
    ``priority``: lower ``Request.priority`` first, then earlier arrival)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    mode: BatchingMode = "continuous"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SchedulerConfigError(name, f"must be an integer >= 1, got {value!r}")
        if self.policy not in ("fcfs", "priority"):
            raise SchedulerConfigError(
                "policy", f"must be 'fcfs' or 'priority', got {self.policy!r}"
            )
        if self.mode not in ("continuous", "static", "none"):
            raise SchedulerConfigError(
                "mode", f"must be 'continuous', 'static' or 'none', got {self.mode!r}"
            )

    @property
    def honours_priority(self) -> bool:
        """``fcfs`` ignores ``Request.priority`` (``scheduling/priority.py``)."""
        return self.policy == "priority"

    def sort_key(self, request: Request, seq: int) -> SortKey:
        return sort_key(self.policy, request, seq)

    def make_queue(self, keys: dict[str, SortKey]) -> RequestQueue:
        return make_queue(self.policy, keys)


def max_running(budgets: Budgets, layout: KVLayout) -> int:
    """Effective cap on running requests (``none`` mode runs one at a time)."""
    return 1 if budgets.mode == "none" else min(budgets.max_num_seqs, layout.max_slots)


def check_budgets(budgets: Budgets, layout: KVLayout) -> None:
    """Raise :class:`SchedulerConfigError` for budgets the scheduler cannot honour on ``layout``."""
    if budgets.long_prefill_token_threshold < 0:
        raise SchedulerConfigError("long_prefill_token_threshold", "must be >= 0 (0 disables it)")
    running = max_running(budgets, layout)
    if budgets.max_num_batched_tokens < running:
        raise SchedulerConfigError(
            "max_num_batched_tokens",
            f"{budgets.max_num_batched_tokens} < {running} running sequences: "
            "decodes could not all get a token every step",
        )
    if not budgets.enable_chunked_prefill and budgets.max_num_batched_tokens < layout.max_model_len:
        raise SchedulerConfigError(
            "max_num_batched_tokens",
            f"must be >= max_model_len ({layout.max_model_len}) without chunked prefill, "
            "or a long prompt could never be scheduled",
        )


def max_chunk(budgets: Budgets) -> int:
    """Most prompt tokens one request computes in a step (drafts never need more blocks than
    are free: they are clipped to them)."""
    threshold = budgets.long_prefill_token_threshold if budgets.enable_chunked_prefill else 0
    return min(budgets.max_num_batched_tokens, threshold or budgets.max_num_batched_tokens)


def blocks_per_window(window: int | None, block_size: int, budgets: Budgets) -> int | None:
    """Most blocks a sequence holds at once when the blocks behind ``window`` are freed and
    prefill is chunked: what a chunk and the window behind it straddle (``window_blocks``).
    None without a window, or without chunked prefill (a preempted request's recompute then
    prefills its whole sequence in one step)."""
    if window is None or not budgets.enable_chunked_prefill:
        return None
    return window_blocks(window, block_size, max_chunk(budgets))


def max_blocks_held(request: Request, layout: KVLayout, budgets: Budgets) -> int:
    """Most blocks ``request`` holds at once: all of its KV, or fewer under a freeing window
    (``blocks_per_window``)."""
    n, size = request.num_prompt_tokens, layout.block_size
    need = -(-max_kv_tokens(n, request.sampling_params.max_tokens, layout.max_model_len) // size)
    bound = blocks_per_window(layout.freeing_window, size, budgets)
    return need if bound is None else min(need, bound)


def check_fits(request: Request, layout: KVLayout, budgets: Budgets) -> None:
    """Raise ValueError if ``request`` could not finish even alone on ``layout``."""
    n, limit = request.num_prompt_tokens, layout.max_model_len
    if n > limit:
        raise ValueError(
            f"request {request.request_id!r}: prompt of {n} tokens > max_model_len {limit}"
        )
    need = max_blocks_held(request, layout, budgets)
    if need > layout.num_blocks:
        raise ValueError(
            f"request {request.request_id!r}: needs up to {need} KV blocks, the pool has "
            f"{layout.num_blocks}"
        )
