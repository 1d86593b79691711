"""The scheduler's own small typed config (it never sees the root config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from inferflow.scheduling.layout import KVLayout
from inferflow.scheduling.policy import PolicyName

BatchingMode = Literal["continuous", "static", "none"]


class SchedulerConfigError(ValueError):
    """An invalid scheduler setting; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SchedulerConfig:
    """Budgets and switches of :class:`~inferflow.scheduling.scheduler.Scheduler`.

    - ``max_num_seqs``: running requests at once (also bounded by ``max_slots``);
    - ``max_num_batched_tokens``: tokens computed per step (decode rows count 1 each);
    - ``max_model_len``: prompt + output limit, and the engine's per-slot KV capacity;
    - ``num_blocks`` x ``block_size``: accounted KV memory (tokens);
    - ``max_slots``: engine slots (rows of the KV buffer ``[max_slots, Hkv, capacity, D]``);
    - ``long_prefill_token_threshold``: cap on one request's prefill chunk per step (0 = none), so
      several prompts can share a step;
    - ``paged``: the KV lives in the pool's blocks (``KVLayout.paged``): plans carry block tables
      instead of slot <-> pool copies;
    - ``mode``: ``continuous`` (admit whenever there is room), ``static`` (form a batch, run it to
      completion, then form the next) or ``none`` (one request at a time).
    """

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    num_blocks: int = 512
    block_size: int = 16
    max_slots: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: PolicyName = "fcfs"
    mode: BatchingMode = "continuous"
    paged: bool = False

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "num_blocks",
            "block_size",
            "max_slots",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SchedulerConfigError(name, f"must be an integer >= 1, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise SchedulerConfigError(
                "long_prefill_token_threshold", "must be >= 0 (0 disables it)"
            )
        if self.policy not in ("fcfs", "priority"):
            raise SchedulerConfigError(
                "policy", f"must be 'fcfs' or 'priority', got {self.policy!r}"
            )
        if self.mode not in ("continuous", "static", "none"):
            raise SchedulerConfigError(
                "mode", f"must be 'continuous', 'static' or 'none', got {self.mode!r}"
            )
        if self.max_num_batched_tokens < self.max_running:
            raise SchedulerConfigError(
                "max_num_batched_tokens",
                f"{self.max_num_batched_tokens} < {self.max_running} running sequences: "
                "decodes could not all get a token every step",
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise SchedulerConfigError(
                "max_num_batched_tokens",
                f"must be >= max_model_len ({self.max_model_len}) without chunked prefill, "
                "or a long prompt could never be scheduled",
            )

    @classmethod
    def for_layout(
        cls,
        layout: KVLayout,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: PolicyName = "fcfs",
        mode: BatchingMode = "continuous",
    ) -> SchedulerConfig:
        """The config whose physical sizes are ``layout``'s (never changed afterwards)."""
        return cls(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=layout.max_model_len,
            num_blocks=layout.num_blocks,
            block_size=layout.block_size,
            max_slots=layout.max_slots,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,
            mode=mode,
            paged=layout.paged,
        )

    @property
    def layout(self) -> KVLayout:
        return KVLayout(
            self.max_slots, self.max_model_len, self.block_size, self.num_blocks, self.paged
        )

    @property
    def max_running(self) -> int:
        """Effective cap on running requests (``none`` mode runs one at a time)."""
        return 1 if self.mode == "none" else min(self.max_num_seqs, self.max_slots)
