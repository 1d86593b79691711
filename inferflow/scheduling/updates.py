"""What the scheduler reports back: per-request updates of a step, and its counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferflow.outputs import TokenLogprob
from inferflow.scheduling.request import Request


@dataclass(frozen=True)
class StepUpdate:
    """One request's progress in one step (what ``LLMEngine`` turns into a RequestOutput delta).

    ``request`` is the live object: ``request.output_token_ids`` is cumulative and already includes
    ``new_token_ids``; ``request.metrics`` has the timestamps.
    """

    request: Request
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...] = ()  # empty unless the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id that matched, if any

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics/telemetry (taken outside the scheduling logic)."""

    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_used: int  # referenced by running requests
    num_kv_blocks_free: int  # allocatable: truly free + cached-unreferenced
    num_kv_blocks_cached: int  # registered in the prefix cache (referenced or not)
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # of which served from the cache
    num_preemptions: int
    num_steps: int
    num_scheduled_tokens: int  # all tokens computed so far (prefill + decode)
    # multi-LoRA (vLLM's ``vllm:lora_requests_info``): the adapters of running / waiting requests
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0  # the engine's slots (0: LoRA off)
    lora_loads: int = 0  # adapters read from disk (registry: at start, runtime loads, re-reads)
    lora_unloads: int = 0  # adapters unloaded at run time
    lora_slot_loads: int = 0  # adapters written into an engine slot (LoraSlots)

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass
class SpecDecodeStats:
    """Speculative decoding since start (vLLM's ``spec_decode`` counters): ``num_drafts`` decode
    rows that carried drafts, ``num_draft_tokens`` drafts verified, ``num_accepted_tokens`` of
    them accepted, ``accepted_per_position[i]`` rows whose draft ``i`` was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per speculative decode row: 1 + accepted drafts on average (vLLM's "mean
        acceptance length"; 0 before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
