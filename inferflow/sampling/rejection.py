"""Verify one request's draft tokens against the target model's logits (speculative decoding).

A row with ``k`` drafts comes back with ``k + 1`` logits rows: row ``j`` is the target's
next-token distribution after the sequence plus ``drafts[:j]`` (row 0 predicts ``drafts[0]``,
row ``k`` the token after the last draft). Drafts are accepted left to right; at the first
rejection the target's own token takes its place and verification ends; when all ``k`` are
accepted, row ``k`` gives one more token (the "bonus"). So a step yields 1 to ``k + 1`` tokens;
an accepted draft that ends the request (EOS, a stop token) is its last.

- greedy: a draft is accepted iff it is the target's argmax, so the output is token for token
  the non-speculative greedy output;
- temperature > 0: rejection sampling (Leviathan et al. 2023; vLLM's method). The n-gram
  proposer's draft distribution q is one-hot, so draft ``x`` is accepted with probability
  ``p(x)`` and, when rejected, the replacement is drawn from the target ``p`` with ``x`` removed
  (``max(0, p - q)`` renormalised): each emitted token is distributed exactly as ``p``.

Each position is a sample of its own (``num_output_tokens`` advanced, and the drafts accepted
before it added to its token history), so ``min_tokens``, per-position seeds, logprobs and the
logits processors (penalties, ``logit_bias``, ``min_p``) behave as without speculation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from inferflow.sampling.sampler import Sampler, SampleRow, with_logprobs
from inferflow.scheduling.plan import SampledToken


def verify_drafts(sampler: Sampler, logits: np.ndarray, row: SampleRow,
                  drafts: Sequence[int]) -> list[SampledToken]:
    """The tokens this step emits for ``row``: its accepted drafts, then one target token.

    ``logits`` is ``(len(drafts) + 1, V)``; the result has 1 to ``len(drafts) + 1`` entries
    and every entry but the last equals the draft at its position.
    """
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"{row.request_id}: {len(drafts)} drafts need {len(drafts) + 1} logits "
                         f"rows, got {logits.shape[0]}")
    params = row.params
    if params.greedy and sampler.plain(row):
        best = np.argmax(logits, axis=-1).tolist()  # the plain greedy row: one argmax
        n = next((j for j, d in enumerate(drafts) if best[j] != d or _ends(sampler, row, d, j)),
                 len(drafts))
        return [SampledToken(t) for t in best[:n + 1]]
    out: list[SampledToken] = []
    for j, draft in enumerate(drafts):
        at = _at(row, tuple(drafts[:j]))
        token = _verify_one(sampler, logits[j], at, draft)
        out.append(with_logprobs(token, logits[j], params))
        if token != draft or _ends(sampler, row, draft, j):
            return out
    bonus = _at(row, tuple(drafts))
    out.append(sampler.sample(logits[-1:], [bonus])[0])
    return out


def _at(row: SampleRow, accepted: tuple[int, ...]) -> SampleRow:
    """``row`` as the sample after its ``accepted`` drafts: later position, longer history."""
    history = row.history
    if history is not None and accepted:
        history = history._replace(accepted=history.accepted + accepted)
    return dataclasses.replace(row, num_output_tokens=row.num_output_tokens + len(accepted),
                               history=history)


def _ends(sampler: Sampler, row: SampleRow, token: int, j: int) -> bool:
    """Whether accepted draft ``token`` at position ``j`` ends the request (EOS unless
    ``ignore_eos``, a stop token id; from ``min_tokens`` on): nothing after it is emitted, so
    what the executor reports is what the request gets (stop strings are the detokenizer's)."""
    params = row.params
    if row.num_output_tokens + j + 1 < params.min_tokens:
        return False
    return (not params.ignore_eos and token in sampler.eos_token_ids) or token in params.stop_token_ids


def _verify_one(sampler: Sampler, logits: np.ndarray, row: SampleRow, draft: int) -> int:
    """The token at one position: ``draft`` if accepted, else the target's replacement."""
    if row.params.greedy:
        return int(np.argmax(sampler.processed_logits(logits, row)))
    p = sampler.target_probs(logits, row)
    rng = sampler.rng(row)  # one generator for both draws (a seeded row's is per position)
    if rng.random() < p[draft]:
        return draft
    residual = p.copy()
    residual[draft] = 0.0  # p - q clipped at 0, q one-hot at the draft
    # residual.sum() > 0 here: a draft with p == 1 is always accepted (random() < 1)
    return sampler.draw(residual / residual.sum(), rng)
