"""The ``speculative`` slot: speculative decoding (a proposer drafts, the target verifies).

Contract (:class:`SpeculativeStage`): :meth:`proposer` builds the scheduler's
:class:`~inferflow.scheduling.speculation.DraftProposer` once, in the engine worker (``None``: no
speculation). Verification is the engine's own: decode rows carry the drafts in the normal
batched step, the sampler accepts or rejects them (``inferflow.sampling.rejection``), the
scheduler rolls the KV length back past rejected ones. Output is the same as without
speculation: token for token under greedy decoding, in distribution at temperature > 0.

Built-ins: ``speculative=none`` (:class:`NoSpeculation`, the default) and ``speculative=ngram``
(:class:`NgramSpeculation`, prompt lookup). A draft-model proposer is a class with a
``proposer()`` that returns one (its own ``_target_``).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from inferflow.config.tunable import tunable
from inferflow.scheduling.speculation import DraftProposer, DraftRequest
from inferflow.stages.engine_slot import EngineStage


@dataclass
class SpeculativeStage(EngineStage):
    """Contract of the ``speculative`` slot (see the module docstring)."""

    kind: ClassVar[str] = "speculative"

    @abstractmethod
    def proposer(self) -> DraftProposer | None:
        """The scheduler's draft proposer (None: decode one token a step)."""

    @property
    def enabled(self) -> bool:
        return True


@dataclass
class NoSpeculation(SpeculativeStage):
    """One token per decode step (the default; what ``~speculative`` gives too)."""

    def proposer(self) -> DraftProposer | None:
        return None

    @property
    def enabled(self) -> bool:
        return False


@dataclass
class NgramSpeculation(SpeculativeStage):
    """Prompt lookup (:class:`NgramProposer`; vLLM's ``method: ngram``). Costs no model; pays
    off where output repeats its context (code edits, extraction, quoting)."""

    # (the tuner's engine model cannot know how often drafts are accepted: real runs decide)
    num_speculative_tokens: int = tunable(4, low=1, high=8, simulated=False,
                                          note="draft length (speculative=ngram only)")
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = tunable(4, low=2, high=6, simulated=False,
                                     note="longest n-gram looked up (>= prompt_lookup_min)")

    def __post_init__(self) -> None:
        self.proposer()  # the range checks, at config time

    def proposer(self) -> DraftProposer | None:
        return NgramProposer(self.num_speculative_tokens, self.prompt_lookup_min,
                             self.prompt_lookup_max)


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram``, llama.cpp's ``lookup``): find the last
    ``n`` tokens earlier in the request's own prompt + output, for the largest ``n`` in
    ``[prompt_lookup_min, prompt_lookup_max]`` that occurs, and propose the tokens that followed
    its most recent earlier occurrence. Stateless; costs O(length) numpy work per request."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int = 2,
                 prompt_lookup_max: int = 4) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min: must be in [1, prompt_lookup_max], got "
                             f"{prompt_lookup_min} (prompt_lookup_max {prompt_lookup_max})")
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(self, requests: Sequence[DraftRequest]) -> list[tuple[int, ...]]:
        return [self.propose_one(r.token_ids, min(r.max_draft_tokens, self.num_speculative_tokens))
                for r in requests]

    def forget(self, request_ids: Iterable[str]) -> None:
        pass  # no per-request state

    def propose_one(self, token_ids: Sequence[int], k: int) -> tuple[int, ...]:
        """Up to ``k`` tokens following the most recent earlier match of the longest suffix."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        last = len(tokens) - 1
        # candidate ends: earlier positions holding the last token (each has a token after it)
        ends = np.flatnonzero(tokens[:last] == tokens[last])
        if ends.size == 0:
            return ()
        # grow every candidate's match backwards, one position at a time, up to the max n
        matched = np.ones(ends.size, dtype=np.int64)
        for d in range(1, min(self.prompt_lookup_max, last)):
            alive = (matched == d) & (ends >= d)
            if not alive.any():
                break
            hit = alive.copy()
            hit[alive] = tokens[ends[alive] - d] == tokens[last - d]
            matched += hit
        best = int(matched.max())
        if best < self.prompt_lookup_min:
            return ()
        start = int(ends[np.flatnonzero(matched == best)[-1]]) + 1  # the latest longest match
        return tuple(tokens[start:start + k].tolist())
