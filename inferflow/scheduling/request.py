"""A request as the scheduler sees it: token ids, progress, status, and pure stop checks."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from inferflow.outputs import RequestMetrics, TokenLogprob
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.block_hash import ExtraKeys


class RequestStatus(enum.IntEnum):
    """Ordered life cycle: every status after ``PREEMPTED`` is final."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, will recompute prompt + output
    FINISHED_STOPPED = 3  # EOS, a stop token id, or a stop string (set by the caller)
    FINISHED_LENGTH_CAPPED = 4  # max_tokens, max_model_len or slot capacity
    FINISHED_ABORTED = 5  # cancelled: client gone, timeout, shutdown

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI/vLLM ``finish_reason`` of a final status, None otherwise."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One generation request. Mutated only by the scheduler.

    Token layout: ``all_token_ids = prompt_token_ids + output_token_ids``; KV exists (in the slot)
    for the first ``num_computed_tokens`` of them. The last sampled token has no KV yet: the next
    decode computes it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0  # lower value = served first (vLLM convention); ties by arrival
    cache_extra_keys: ExtraKeys = ()  # e.g. LoRA id: mixed into every prefix-cache key
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token if requested
    num_computed_tokens: int = 0
    slot: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id (or stop string) that ended it
    # n > 1: the sibling request with the same prompt, submitted first; this one is admitted
    # once the leader's prompt is computed, so its full blocks are prefix-cache hits
    prompt_leader: str | None = None
    # multi-LoRA: the adapter it runs with (None: the base model); its prefix-cache blocks are
    # keyed by it (``cache_extra_keys`` defaults to ("lora", name))
    lora: str | None = None
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)
        if self.lora is not None and not self.cache_extra_keys:
            self.cache_extra_keys = ("lora", self.lora)  # never a block of another adapter's
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        # prompt + output, kept in step with output_token_ids by append_output()
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids
        # SamplingParams.prompt_logprobs: one entry per prompt token (the first None), filled
        # chunk by chunk; complete once the prefill that computes the whole prompt ran
        self._prompt_logprobs: list[TokenLogprob | None] | None = None
        self._prompt_logprobs_done = False

    @property
    def computes_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and has not got them yet: its prefill chunks return
        every position's logits (and so it takes no prefix-cache hits)."""
        return self.sampling_params.prompt_logprobs is not None and not self._prompt_logprobs_done

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs once computed (None before, and without prompt_logprobs)."""
        return self._prompt_logprobs if self._prompt_logprobs_done else None

    def record_prompt_logprobs(self, first_position: int, entries: Sequence[TokenLogprob],
                               complete: bool) -> None:
        """Logprobs of prompt tokens ``first_position, first_position + 1, ...`` (one prefill
        chunk's); ``complete``: that chunk ended the prompt."""
        if self._prompt_logprobs is None:
            self._prompt_logprobs = [None] * self.num_prompt_tokens
        self._prompt_logprobs[first_position:first_position + len(entries)] = entries
        self._prompt_logprobs_done = complete

    def append_output(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        """Record one sampled token (the only way output grows)."""
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep the first ``num_output_tokens`` outputs of a finished request (a stop string
        matched inside a step that emitted several tokens: the rest were never "generated")."""
        if not self.is_finished:
            raise ValueError(f"request {self.request_id!r}: only a finished request is truncated")
        del self.output_token_ids[num_output_tokens:]
        del self._all_token_ids[self.num_prompt_tokens + num_output_tokens:]
        del self.logprobs[num_output_tokens:]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """prompt + output (the live list: do not mutate)."""
        return self._all_token_ids

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens without KV yet: the rest of the prompt, or 1 (the last sampled token) when decoding."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def token_slice(self, start: int, end: int) -> tuple[int, ...]:
        return tuple(self._all_token_ids[start:end])


# -- stop checks: pure functions ---------------------------------------------------------------


@dataclass(frozen=True)
class StopDecision:
    status: RequestStatus  # FINISHED_STOPPED or FINISHED_LENGTH_CAPPED
    stop_reason: int | None = None  # the stop token id, when one matched (None for EOS)


def check_stop_token(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_ids: Sequence[int]
) -> StopDecision | None:
    """EOS (unless ``ignore_eos``) or one of ``stop_token_ids``; neither before ``min_tokens``."""
    if num_output_tokens < params.min_tokens:
        return None
    if not params.ignore_eos and token_id in eos_token_ids:
        return StopDecision(RequestStatus.FINISHED_STOPPED)
    if token_id in params.stop_token_ids:
        return StopDecision(RequestStatus.FINISHED_STOPPED, stop_reason=token_id)
    return None


def check_length(
    num_output_tokens: int, num_tokens: int, max_tokens: int, max_model_len: int
) -> StopDecision | None:
    """``max_tokens`` generated, or prompt + output reached ``max_model_len`` (vLLM semantics).

    Slot capacity is ``max_model_len`` positions, so a sequence stopped here never needs KV beyond
    position ``max(prompt_len, max_model_len - 1) - 1``.
    """
    if num_output_tokens >= max_tokens or num_tokens >= max_model_len:
        return StopDecision(RequestStatus.FINISHED_LENGTH_CAPPED)
    return None


def max_kv_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """Most tokens with KV a request can ever hold, given the length checks above: the sequence
    ends at ``min(prompt + max_tokens, max(prompt + 1, max_model_len))`` tokens, the last of which
    is sampled but never computed; with ``max_tokens`` 0, the prompt (computed, nothing sampled)."""
    n = num_prompt_tokens
    return max(n, min(n + max_tokens, max(n + 1, max_model_len)) - 1)


def check_stop(request: Request, max_model_len: int) -> StopDecision | None:
    """Stop decision after ``request``'s last output token was appended (token checks win)."""
    params = request.sampling_params
    last = request.output_token_ids[-1]
    return check_stop_token(
        last, request.num_output_tokens, params, request.eos_token_ids
    ) or check_length(
        request.num_output_tokens, request.num_tokens, params.max_tokens, max_model_len
    )
