"""Per-request sampling and stopping parameters (vLLM-compatible names)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


# ``GuidedConstraint``: what a request's output must match, as it travels to the engine. Built by
# the HTTP layer from ``response_format``, ``structured_outputs`` or vLLM's ``guided_*`` fields
# (``server/http/guided_fields.py``), or directly offline through ``SamplingParams(guided=...)``.
# Plain data (picklable, hashable): the grammar stage compiles it, cached by ``key``.
class GuidedKind(str, Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec: ""
    REGEX = "regex"  # spec: the regular expression (Rust ``regex`` syntax)
    CHOICE = "choice"  # spec: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # spec: a Lark or GBNF (llama.cpp) grammar


@dataclass(frozen=True)
class GuidedConstraint:
    kind: GuidedKind
    spec: str = ""
    field: str = "structured_outputs"  # the request field it came from, named in 400s

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (not where the request spelled it)."""
        return (self.kind.value, self.spec)

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | str, field: str = "guided_json"
    ) -> GuidedConstraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order matters
        return cls(GuidedKind.JSON_SCHEMA, text, field)

    @classmethod
    def choice(cls, choices: list[str], field: str = "guided_choice") -> GuidedConstraint:
        return cls(GuidedKind.CHOICE, json.dumps(list(choices)), field)


class GuidedError(ValueError):
    """A constraint that cannot be compiled; ``field`` names the request field (HTTP 400)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; ``field`` names it (used for HTTP 400s)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class RequestOutputKind(Enum):
    """What ``LLMEngine.step`` reports of a request (vLLM's names).

    - ``CUMULATIVE``: every output holds the whole text, token ids and logprobs so far, and the
      step's ``delta_*``; each one copies what came before (O(n) per output).
    - ``DELTA``: ``text``, ``token_ids`` and ``logprobs`` hold only what is new since the
      request's previous output (what a streaming server sends): no copies of the past.
    - ``FINAL_ONLY``: one output, when the request finishes, cumulative (what ``LLM.generate``
      returns; its ``delta_*`` are then the whole completion): nothing is built while it runs.

    A DELTA request's ``prompt`` and ``prompt_token_ids`` are in its first output only.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature == 0`` means greedy (argmax); ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes sampling reproducible per request, independent of batch composition.
    ``stop`` strings are matched on detokenized text and are not included in the output;
    ``stop_token_ids`` (and EOS unless ``ignore_eos``) end generation at the token level.
    ``logprobs=n`` returns the sampled token's logprob plus the top-n alternatives.
    ``guided`` constrains the output (structured output: a JSON schema, regex, choice or grammar;
    the engine's ``guided`` stage compiles it). ``output_kind`` says what the engine's outputs
    hold (:class:`RequestOutputKind`).

    Sampling controls (vLLM's and OpenAI's meanings; applied to the logits before temperature,
    top-k, top-p and ``min_p``; reported logprobs stay those of the raw distribution):
    ``presence_penalty`` / ``frequency_penalty`` subtract ``p`` once / ``f`` per occurrence of
    each token already *generated*; ``repetition_penalty`` (transformers' CTRL form) divides a
    positive logit (multiplies a negative one) of every token in the prompt or the output;
    ``min_p`` drops tokens whose probability is below ``min_p`` times the top one's;
    ``logit_bias`` adds a bias to the given token ids.

    ``n`` sequences are returned per prompt (``best_of`` >= ``n`` are generated and the ``n``
    with the highest cumulative logprob kept); the prompt is computed once and its KV shared.
    A choice ``i`` of a seeded request samples with ``seed + i``.
    ``prompt_logprobs=k`` returns each prompt token's logprob (the first is ``None``) and the top
    ``k`` alternatives; it costs a full-vocabulary row per prompt token and bypasses the prefix
    cache (cached tokens have no logits). ``max_tokens=0`` computes the prompt only (with
    ``prompt_logprobs``: what an evaluation harness's loglikelihood request needs).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    guided: GuidedConstraint | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    n: int = 1
    best_of: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """A penalty, ``min_p`` or ``logit_bias`` changes the logits before sampling."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.min_p or self.logit_bias
        )

    def validate(self) -> None:
        """Raise :class:`SamplingParamsError` naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise SamplingParamsError("max_tokens", f"must be an integer >= 0, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamsError("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise SamplingParamsError("top_k", f"must be -1, 0 (disabled) or >= 1, got {self.top_k!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise SamplingParamsError("seed", f"must be a non-negative integer, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SamplingParamsError("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError("stop_token_ids", "must be non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise SamplingParamsError("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamsError("min_tokens", "must be in [0, max_tokens]")
        if self.guided is not None and not isinstance(self.guided, GuidedConstraint):
            raise SamplingParamsError("guided", "must be a GuidedConstraint")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise SamplingParamsError("output_kind", "must be a RequestOutputKind")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"must be in [-2, 2], got {value!r}")
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise SamplingParamsError(
                "repetition_penalty", f"must be in (0, 100], got {self.repetition_penalty!r}"
            )
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise SamplingParamsError("logit_bias", f"keys must be token ids, got {token!r}")
                if not _number(bias) or not -100.0 <= bias <= 100.0:
                    raise SamplingParamsError(
                        "logit_bias", f"biases must be in [-100, 100], got {bias!r} for {token}"
                    )
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise SamplingParamsError("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.best_of is not None and (
            not isinstance(self.best_of, int) or not self.n <= self.best_of <= MAX_N
        ):
            raise SamplingParamsError(
                "best_of", f"must be an integer in [n, {MAX_N}], got {self.best_of!r}"
            )
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise SamplingParamsError(
                "prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}"
            )

    @property
    def num_sequences(self) -> int:
        """Sequences generated per prompt: ``best_of`` if set, else ``n``."""
        return self.best_of or self.n


MAX_N = 16  # choices per prompt (n, best_of): each is a sequence in the engine


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
