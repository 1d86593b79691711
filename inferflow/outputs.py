"""What generation returns, offline (``LLM.generate``) and per engine step (``LLMEngine.step``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Logprob of one generated token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class StageTime:
    """A per-request stage that runs many times (e.g. detokenization after every step): its
    first start, last end (``time.time()``), number of runs and the seconds actually spent."""

    start: float
    end: float
    calls: int = 1
    busy_s: float = 0.0

    def add(self, start: float, end: float) -> None:
        self.end = max(self.end, end)
        self.calls += 1
        self.busy_s += end - start


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (``time.time()``) and counters of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None  # queue time = first_scheduled - arrival
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    detokenize: StageTime | None = None  # the detokenizer stage's runs for this request
    guided_kind: str | None = None  # structured output: the constraint's kind
    guided_compile_s: float | None = None  # compiling its grammar (0 when cached)
    guided_cache_hit: bool | None = None


@dataclass
class CompletionOutput:
    """One generated sequence. ``text``/``token_ids``/``logprobs`` are cumulative (or, for a
    request with ``output_kind=RequestOutputKind.DELTA``, what is new since its previous
    output); ``delta_*`` are what this output added (what a streaming frontend sends)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token that matched
    logprobs: list[TokenLogprob] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's output of a step. ``prompt``/``prompt_token_ids``: the prompt (for a
    DELTA request, in its first output only; None and empty in the later ones).
    ``prompt_logprobs`` (requests with ``SamplingParams.prompt_logprobs``): one entry per prompt
    token, the first ``None``; present wherever ``prompt_token_ids`` is. ``outputs`` holds
    ``SamplingParams.n`` sequences (``index`` 0..n-1)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
