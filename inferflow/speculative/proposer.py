"""Draft proposers: given a request's tokens so far, guess the next few.

The contract is batched (one call per engine step over every decoding request that may
speculate), so a draft-model proposer can run its own model once per step; it is told when
requests end (``forget``) so it can drop per-request state such as its own KV cache. A proposer
never decides correctness: the target model verifies every draft, so a bad guess costs compute,
never output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class DraftRequest:
    """One decoding request asking for drafts in this step."""

    request_id: str
    token_ids: Sequence[int]  # prompt + output so far; the last one is sampled, without KV yet
    max_draft_tokens: int  # at most this many drafts (>= 1): max_tokens, context and budget allow


class DraftProposer(Protocol):
    """Proposes up to ``num_speculative_tokens`` drafts per request (fewer, or none, is fine)."""

    num_speculative_tokens: int

    def propose(self, requests: Sequence[DraftRequest]) -> list[tuple[int, ...]]:
        """Drafts for each request, in order: the tokens guessed to follow ``token_ids``, at
        most ``max_draft_tokens`` of them (``()``: nothing to propose)."""
        ...

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests finished or were preempted: drop any state kept for them."""
        ...


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
