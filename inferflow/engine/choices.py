"""``n`` and ``best_of``: one prompt fanned out into several engine requests, merged back.

An engine request is one sequence. A prompt with ``SamplingParams.num_sequences`` > 1 becomes
that many requests (:func:`fan_out`): the first is the *leader*, the others name it as their
``prompt_leader``, so the scheduler starts them once the leader has computed the prompt and they
read its full blocks from the prefix cache (the prompt is computed once). Choice ``i`` of a seeded
request samples with ``seed + i``; only the leader computes ``prompt_logprobs`` (a request that
computes them takes no cache hits). With ``best_of`` > ``n`` every sequence reports its sampled
tokens' logprobs (kept internal unless asked) and :func:`merge` keeps the ``n`` with the highest
cumulative logprob, best first (vLLM's rule); otherwise choices keep their order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from inferflow.outputs import CompletionOutput, RequestOutput
from inferflow.sampling_params import SamplingParams


@dataclass(frozen=True)
class Choice:
    """One engine request of a fanned-out prompt."""

    request_id: str
    params: SamplingParams  # n=1, best_of=None: one sequence
    prompt_leader: str | None  # None for the leader (choice 0)


def choice_id(request_id: str, index: int) -> str:
    """The engine request id of choice ``index`` of ``request_id``."""
    return f"{request_id}-{index}"


def fan_out(request_id: str, params: SamplingParams) -> list[Choice]:
    """The engine requests of one prompt: ``params.num_sequences`` of them, the first the
    leader. A single sequence keeps ``request_id`` and ``params`` as they are."""
    count = params.num_sequences
    if count == 1:
        return [Choice(request_id, dataclasses.replace(params, n=1, best_of=None), None)]
    ranks = params.best_of is not None and params.best_of > params.n
    leader = choice_id(request_id, 0)
    choices = []
    for i in range(count):
        one = dataclasses.replace(
            params, n=1, best_of=None,
            seed=None if params.seed is None else params.seed + i,
            # best_of ranks by cumulative logprob: each token's logprob is needed
            logprobs=0 if ranks and params.logprobs is None else params.logprobs,
            prompt_logprobs=params.prompt_logprobs if i == 0 else None)
        choices.append(Choice(choice_id(request_id, i), one, None if i == 0 else leader))
    return choices


def cumulative_logprob(completion: CompletionOutput) -> float:
    """Sum of the sampled tokens' logprobs (the sequence's log-likelihood)."""
    return sum(lp.logprob for lp in completion.logprobs or ())


def merge(request_id: str, params: SamplingParams, outputs: Sequence[RequestOutput]) -> RequestOutput:
    """One prompt's final output from its choices' final outputs (in :func:`fan_out` order):
    ``n`` CompletionOutputs indexed 0..n-1 (with ``best_of`` > n, the n best by cumulative
    logprob, best first; logprobs only where the request asked)."""
    completions = [out.outputs[0] for out in outputs]
    if params.best_of is not None and params.best_of > params.n:
        completions = sorted(completions, key=cumulative_logprob, reverse=True)[:params.n]
    keep_logprobs = params.logprobs is not None
    merged = [dataclasses.replace(c, index=i, logprobs=c.logprobs if keep_logprobs else None)
              for i, c in enumerate(completions)]
    lead = outputs[0]
    return RequestOutput(request_id, lead.prompt, lead.prompt_token_ids, merged,
                         finished=all(out.finished for out in outputs), metrics=lead.metrics,
                         prompt_logprobs=lead.prompt_logprobs)
