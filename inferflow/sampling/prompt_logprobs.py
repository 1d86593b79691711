"""Prompt logprobs (``SamplingParams.prompt_logprobs``) from a prefill chunk's logits rows.

The logits at position j predict token j + 1, so a chunk over positions ``[s, s + L)`` gives
the logprobs of prompt tokens ``s + 1 ... s + L`` (``ScheduledChunk.prompt_logprob_ids``). A
full-vocabulary row per prompt token is the expensive part: the log-softmax runs on a few rows
at a time and only each token's logprob and its top-k are kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from inferflow.sampling.sampler import log_softmax, top_logprobs
from inferflow.scheduling.plan import SampledToken

ROWS_PER_BLOCK = 16  # rows log-softmaxed at once (float64 scratch: 16 x V x 8 bytes)


def prompt_logprobs(logits: np.ndarray, token_ids: Sequence[int], k: int) -> tuple[SampledToken, ...]:
    """``logits`` (>= len(token_ids), V): row i predicts ``token_ids[i]``. One entry per token:
    its raw logprob and the ``k`` most likely tokens at that position (none for k = 0)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    entries: list[SampledToken] = []
    for at in range(0, len(ids), ROWS_PER_BLOCK):
        block = log_softmax(logits[at:at + min(ROWS_PER_BLOCK, len(ids) - at)])  # (b, V) float64
        chosen = block[np.arange(len(block)), ids[at:at + len(block)]]
        entries += [SampledToken(int(t), float(lp), top_logprobs(row, k))
                    for t, lp, row in zip(ids[at:at + len(block)], chosen, block, strict=True)]
    return tuple(entries)
