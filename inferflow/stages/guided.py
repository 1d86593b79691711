"""The ``guided`` slot: structured output (JSON Schema, JSON object, regex, choice, grammar).

Contract (:class:`GuidedDecodingStage`), driven by the engine on its thread:

- :meth:`check` refuses a constraint that cannot compile (``GuidedError`` -> HTTP 400 naming the
  field, with the compiler's message). It needs no tokenizer, so the API process calls it too,
  before anything is queued.
- :meth:`start` when a constrained request is added: the request's matcher, from a compiled
  grammar cached by the constraint (``GuidedConstraint.key``), so a schema sent by many requests
  is compiled once.
- :meth:`bitmasks` every step, for the constrained requests that sample in it: one packed row
  of allowed tokens each (``inferflow.sampling.bitmask``). The executor's sampler masks those rows
  before sampling (greedy or random); unconstrained rows are not touched.
- :meth:`advance` with each sampled token; ``True`` when the grammar is complete and allows no
  continuation, and the engine then ends the request (``finish_reason: "stop"``). A request
  that runs out of ``max_tokens`` first ends with ``"length"`` and what it produced.
- :meth:`finish` drops the state of finished requests (not of preempted ones: their output is
  kept, so their matcher stays in step).

Built-ins: :class:`LLGuidanceDecoding` (``guided=llguidance``, the default; llguidance builds its
tokenizer straight from ``tokenizer.json``) and :class:`NoGuidedDecoding` (``guided=none`` or
``~guided``: constrained requests are refused with a 400, never served unconstrained).
"""

from __future__ import annotations

import json
import logging
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from inferflow.sampling_params import GuidedConstraint, GuidedError, GuidedKind
from inferflow.stages.engine_slot import EngineStage

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileInfo:
    """How a request's grammar was obtained (:meth:`GuidedDecodingStage.start`)."""

    seconds: float  # compiling it (0 when it came from the cache)
    cached: bool


@dataclass
class GuidedDecodingStage(EngineStage):
    """Contract of the ``guided`` slot (see the module docstring)."""

    kind: ClassVar[str] = "guided"

    @abstractmethod
    def check(self, constraint: GuidedConstraint) -> None:
        """Raise ``GuidedError`` if ``constraint`` cannot be compiled (no tokenizer needed)."""

    def bind(self, tokenizer_path: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """Engine side, once, before the first :meth:`start`: the model's tokenizer."""

    @abstractmethod
    def start(self, request_id: str, constraint: GuidedConstraint) -> CompileInfo:
        """A new constrained request; raises ``GuidedError`` if it cannot be compiled."""

    @abstractmethod
    def constrains(self, request_id: str) -> bool:
        """Whether ``request_id`` is a live constrained request."""

    @abstractmethod
    def bitmasks(self, request_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """Allowed-token bitmask rows ((ceil(V/32),) int32) of these constrained requests."""

    @abstractmethod
    def advance(self, request_id: str, token_id: int) -> bool:
        """Feed the sampled token; True when the grammar is complete (end the request)."""

    @abstractmethod
    def finish(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests (unknown ids are ignored)."""

    def stats(self) -> dict[str, float]:
        """Counters for ``/metrics`` (compile and mask time, grammar cache hits)."""
        return {}


@dataclass
class NoGuidedDecoding(GuidedDecodingStage):
    """No structured output: a request that asks for it is refused (400), never run free."""

    def check(self, constraint: GuidedConstraint) -> None:
        raise GuidedError(
            constraint.field,
            "structured output is disabled on this server (guided=none); "
            "start it with guided=llguidance",
        )

    def start(self, request_id: str, constraint: GuidedConstraint) -> CompileInfo:
        self.check(constraint)
        raise AssertionError("unreachable: check() always raises")

    def constrains(self, request_id: str) -> bool:
        return False

    def bitmasks(self, request_ids: Sequence[str]) -> dict[str, np.ndarray]:
        return {}

    def advance(self, request_id: str, token_id: int) -> bool:
        return False

    def finish(self, request_ids: Iterable[str]) -> None:
        return None


@dataclass
class LLGuidanceDecoding(GuidedDecodingStage):
    """Structured output with llguidance (JSON Schema, regex, choice, Lark/GBNF grammars).

    ``cache_size``: compiled grammars kept (least recently used go first).
    ``whitespace_flexible``: whether JSON output may contain arbitrary whitespace between tokens
    (off: compact JSON with ``", "`` and ``": "`` separators, what clients expect to parse).
    ``threads``: threads filling the masks of one step (llguidance releases the GIL).
    """

    cache_size: int = 256
    whitespace_flexible: bool = False
    threads: int = 2

    def __post_init__(self) -> None:
        if self.cache_size < 1:
            raise ValueError(f"cache_size: must be >= 1, got {self.cache_size}")
        if self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        # engine-side state (not config fields), touched by the engine thread only
        self._tokenizer: Any = None  # llguidance.LLTokenizer, once bound
        self._vocab_size = 0
        self._executor: Any = None  # llguidance.LLExecutor for parallel mask filling
        self._templates: OrderedDict[tuple[str, str], Any] = OrderedDict()  # key -> LLMatcher
        self._matchers: dict[str, Any] = {}  # request id -> its LLMatcher
        self._counters = dict.fromkeys(
            ("compiles", "cache_hits", "compile_seconds", "mask_rows", "mask_seconds"), 0.0
        )

    # --- the grammar ------------------------------------------------------------------------
    def grammar(self, constraint: GuidedConstraint) -> str:
        """The llguidance grammar of ``constraint`` (not yet validated)."""
        import llguidance

        matcher = llguidance.LLMatcher
        options: JsonCompileOptions = {"whitespace_flexible": self.whitespace_flexible}
        if not self.whitespace_flexible:
            options["item_separator"], options["key_separator"] = ", ", ": "
        try:
            if constraint.kind is GuidedKind.JSON_SCHEMA:
                return matcher.grammar_from_json_schema(constraint.spec, defaults=options)
            if constraint.kind is GuidedKind.JSON_OBJECT:
                return matcher.grammar_from_json_schema('{"type": "object"}', defaults=options)
            if constraint.kind is GuidedKind.REGEX:
                return matcher.grammar_from_regex(constraint.spec)
            if constraint.kind is GuidedKind.CHOICE:
                choices = json.loads(constraint.spec)
                if not choices:
                    raise GuidedError(constraint.field, "needs at least one choice")
                return llguidance.grammar_from("choice", json.dumps(choices))
            return llguidance.grammar_from("grammar", constraint.spec)  # Lark, or GBNF
        except GuidedError:
            raise
        except ValueError as exc:
            raise GuidedError(constraint.field, str(exc)) from None

    def check(self, constraint: GuidedConstraint) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(self.grammar(constraint), self._tokenizer)
        if error:
            raise GuidedError(constraint.field, error.strip())

    # --- engine side --------------------------------------------------------------------------
    def bind(self, tokenizer_path: Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance

        eos = list(eos_token_ids) or None
        self._tokenizer = llguidance.LLTokenizer(
            str(tokenizer_path), n_vocab=vocab_size, eos_token=eos
        )
        self._vocab_size = vocab_size
        self._executor = llguidance.LLExecutor(self.threads) if self.threads > 1 else None

    def start(self, request_id: str, constraint: GuidedConstraint) -> CompileInfo:
        import llguidance

        if self._tokenizer is None:
            raise RuntimeError("LLGuidanceDecoding.start before bind()")
        template = self._templates.get(constraint.key)
        info = CompileInfo(0.0, cached=True)
        if template is not None:
            self._templates.move_to_end(constraint.key)
            self._counters["cache_hits"] += 1
        else:
            started = time.perf_counter()  # (compiled once: the matcher reports a bad grammar)
            template = llguidance.LLMatcher(self._tokenizer, self.grammar(constraint), log_level=0)
            if template.is_error():
                raise GuidedError(constraint.field, template.get_error())
            info = CompileInfo(time.perf_counter() - started, cached=False)
            self._counters["compiles"] += 1
            self._counters["compile_seconds"] += info.seconds
            self._templates[constraint.key] = template
            while len(self._templates) > self.cache_size:
                self._templates.popitem(last=False)
        self._matchers[request_id] = template.deep_copy()
        return info

    def constrains(self, request_id: str) -> bool:
        return request_id in self._matchers

    def bitmasks(self, request_ids: Sequence[str]) -> dict[str, np.ndarray]:
        import llguidance.numpy as lln

        if not request_ids:
            return {}
        started = time.perf_counter()
        mask = lln.allocate_token_bitmask(len(request_ids), self._vocab_size)
        matchers = [self._matchers[rid] for rid in request_ids]
        if self._executor is not None and len(matchers) > 1:
            lln.fill_next_token_bitmask_par(
                self._executor, [(m, i) for i, m in enumerate(matchers)], mask
            )
        else:
            for i, m in enumerate(matchers):
                lln.fill_next_token_bitmask(m, mask, i)
        self._counters["mask_rows"] += len(request_ids)
        self._counters["mask_seconds"] += time.perf_counter() - started
        return {rid: mask[i] for i, rid in enumerate(request_ids)}

    def advance(self, request_id: str, token_id: int) -> bool:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        if not matcher.consume_token(token_id):
            # only a sampler that ignored the bitmask gets here: end the request, say why
            logger.error(
                "request %s: token %d breaks its grammar (%s); ending it",
                request_id,
                token_id,
                matcher.get_error(),
            )
            return True
        return bool(matcher.is_stopped())

    def finish(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._matchers.pop(rid, None)

    def stats(self) -> dict[str, float]:
        return {**self._counters, "active": float(len(self._matchers))}
