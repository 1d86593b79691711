"""The scheduler's side of speculative decoding: which decodes get drafts, how many, and the KV
rollback once they were verified (the proposer drafts; the executor verifies).

The :class:`DraftProposer` contract is batched (one call per engine step over every decoding
request that may speculate), so a draft-model proposer can run its own model once per step; it is
told when requests end (``forget``) so it can drop per-request state such as its own KV cache. A
proposer never decides correctness: the target model verifies every draft, so a bad guess costs
compute, never output. The n-gram proposer is in ``stages/speculative.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from inferflow.scheduling.kv_cache_manager import KVCacheManager
from inferflow.scheduling.plan import SampledToken, ScheduledChunk
from inferflow.scheduling.request import Request
from inferflow.scheduling.updates import SpecDecodeStats


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


class DraftPlanner:
    """Asks ``proposer`` for drafts once per step and keeps the ``SpecDecodeStats``."""

    def __init__(self, proposer: DraftProposer, max_model_len: int) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()

    def propose(self, decodes: Iterable[Request]) -> dict[str, tuple[int, ...]]:
        """Drafts for the decoding requests that may speculate (one proposer call): each at most
        ``num_speculative_tokens``, and few enough that the drafts plus the token after them fit
        ``max_tokens`` and the context. Constrained (structured-output) requests decode one
        token a step: their grammar gives the mask of one position only. Prompts are not
        drafted into: a request speculates from its second output token on."""
        asks = []
        for r in decodes:
            room = min(r.sampling_params.max_tokens - r.num_output_tokens,
                       self.max_model_len - r.num_tokens) - 1
            # (a prompt's last token is prefill work: its row samples the first output token)
            if room > 0 and r.num_output_tokens and r.sampling_params.guided is None:
                asks.append(DraftRequest(r.request_id, r.all_token_ids,
                                         min(room, self.proposer.num_speculative_tokens)))
        if not asks:
            return {}
        drafts = self.proposer.propose(asks)
        return {a.request_id: tuple(d[:a.max_draft_tokens])
                for a, d in zip(asks, drafts, strict=True) if d}

    def forget(self, request_ids: Iterable[str]) -> None:
        self.proposer.forget(request_ids)

    @staticmethod
    def clip(drafts: tuple[int, ...], budget: int, room: int) -> tuple[int, ...]:
        """As many drafts as the step's remaining token ``budget`` (one goes to the decode token
        itself) and ``room`` (KV positions the free blocks cover beyond it) allow."""
        return drafts[:max(0, min(budget - 1, room))]

    def roll_back(self, request: Request, chunk: ScheduledChunk,
                  tokens: tuple[SampledToken, ...], kv: KVCacheManager) -> None:
        """After the step: keep the KV of the accepted drafts (``tokens[:-1]``), give back the
        blocks past them (the rejected drafts' KV is overwritten by later steps)."""
        accepted = len(tokens) - 1
        if tuple(t.token_id for t in tokens[:-1]) != chunk.draft_token_ids[:accepted]:
            raise ValueError(f"executor accepted tokens that are not {chunk.request_id!r}'s drafts")
        request.num_computed_tokens += accepted
        kv.shrink(request.request_id, request.num_computed_tokens)
        self.stats.record(len(chunk.draft_token_ids), accepted)
