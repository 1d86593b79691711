"""Logits processors: what changes a row's logits before temperature, top-k, top-p and ``min_p``.

A processor maps one row's ``(V,)`` float64 logits to new ones, given the request's
:class:`SamplingParams` and :class:`TokenHistory` (prompt and output before the sampled
position). The sampler runs the built-in ones (:data:`BUILTIN_PROCESSORS`, vLLM's order: bias,
then the repetition penalty, then presence/frequency), then those the ``executor`` config adds
(``executor.logits_processors``: a plugin's), then the row's masks (bitmask, ``min_tokens``), so
a processor never un-masks a token. Greedy rows are processed too (a penalty moves the argmax).

Reported logprobs stay those of the raw logits (OpenAI's and vLLM's convention); ``min_p`` is a
filter of the tempered distribution (``sampler.filtered_probs``), not a processor.

Rows no processor :meth:`~LogitsProcessor.applies` to keep the sampler's batched fast paths, so
``applies`` must be cheap (attribute checks).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.plan import TokenHistory


@runtime_checkable
class LogitsProcessor(Protocol):
    """One processing step of a row's logits (vLLM v1's ``LogitsProcessor``, per row)."""

    def applies(self, params: SamplingParams) -> bool:
        """Whether rows of a request with ``params`` are processed (cheap: called every step)."""
        ...

    def apply(self, logits: np.ndarray, params: SamplingParams,
              history: TokenHistory) -> np.ndarray:
        """``(V,)`` float64 logits -> processed ``(V,)`` logits. ``logits`` is the sampler's own
        copy: modifying it in place and returning it is fine. ``-inf`` means "never sampled"."""
        ...


def _ids(tokens: list[int], vocab: int) -> np.ndarray:
    ids = np.asarray(tokens, dtype=np.int64)
    return ids[(ids >= 0) & (ids < vocab)]


class LogitBias:
    """``logit_bias``: add each token id's bias (ids are checked against the vocabulary when the
    request is added; one past this row's width is ignored)."""

    def applies(self, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    def apply(self, logits: np.ndarray, params: SamplingParams,
              history: TokenHistory) -> np.ndarray:
        bias = params.logit_bias
        assert bias  # (applies)
        ids = np.fromiter(bias.keys(), np.int64, len(bias))
        values = np.fromiter(bias.values(), np.float64, len(bias))
        keep = (ids >= 0) & (ids < logits.size)
        logits[ids[keep]] += values[keep]  # (the ids are distinct: dict keys)
        return logits


class RepetitionPenalty:
    """``repetition_penalty`` (CTRL; transformers' ``RepetitionPenaltyLogitsProcessor``, vLLM's):
    every token of the prompt or the output so far has a positive logit divided by the penalty,
    a negative one multiplied by it."""

    def applies(self, params: SamplingParams) -> bool:
        return params.repetition_penalty != 1.0

    def apply(self, logits: np.ndarray, params: SamplingParams,
              history: TokenHistory) -> np.ndarray:
        mask = np.zeros(logits.size, dtype=bool)
        mask[_ids(history.all_ids(), logits.size)] = True
        seen = np.flatnonzero(mask)  # each token once, however often it occurs
        x = logits[seen]
        penalty = params.repetition_penalty
        with np.errstate(over="ignore"):  # a denormal penalty: +inf, capped by the sampler
            logits[seen] = np.where(x > 0, x / penalty, x * penalty)
        return logits


class PresenceFrequencyPenalty:
    """``presence_penalty`` and ``frequency_penalty`` (OpenAI's, vLLM's): over the tokens
    *generated* so far, ``logit -= presence * (count > 0) + frequency * count``."""

    def applies(self, params: SamplingParams) -> bool:
        return bool(params.presence_penalty or params.frequency_penalty)

    def apply(self, logits: np.ndarray, params: SamplingParams,
              history: TokenHistory) -> np.ndarray:
        # only the generated tokens are touched: O(output), not O(V)
        ids, counts = np.unique(_ids(history.output_ids(), logits.size), return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts
        return logits


# applied first, in this order, to every row they apply to
BUILTIN_PROCESSORS: tuple[LogitsProcessor, ...] = (
    LogitBias(), RepetitionPenalty(), PresenceFrequencyPenalty(),
)
