"""How one OpenAI request fans out into engine requests: one per (prompt, sequence).

A ``/v1/completions`` request with k prompts and ``n`` choices (``best_of`` sequences when set)
is k * n engine requests; a chat request is ``n``. Choice ``i`` of prompt ``p`` is returned as
``index = p * n + i`` (OpenAI's and vLLM's order). The first sequence of each prompt is its
*leader*: the others name it in ``SubmitRequest.prompt_leader`` (the engine starts them once the
leader's prompt KV is cached, so the prompt is computed once), and only the leader asks for
prompt logprobs (every choice of the prompt renders them from the shared ``PromptInfo``).
Seeded requests sample choice ``i`` with ``seed + i``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from inferflow.sampling_params import SamplingParams
from inferflow.server.http.errors import bad_request
from inferflow.server.http.protocol import ChatCompletionRequest, CompletionRequest
from inferflow.server.http.responses import CompletionFormatter, PromptInfo, ResponseFormatter

if TYPE_CHECKING:
    from inferflow.models.tokenizer import Tokenizer
    from inferflow.server.http.pipeline import PreparedRequest


def count_choices(body: CompletionRequest | ChatCompletionRequest, limit: int) -> int:
    """Engine requests ``body`` needs (prompts x sequences); over ``limit`` is a 400 naming
    ``n`` (``best_of``) or, for a single sequence per prompt, ``prompt``."""
    prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
    count = prompts * body.num_sequences
    if count > limit:
        field = "prompt" if body.num_sequences == 1 else (
            "best_of" if isinstance(body, CompletionRequest) and body.best_of else "n"
        )
        raise bad_request(
            f"this request asks for {count} choices ({prompts} prompt(s) x "
            f"{body.num_sequences} sequence(s)); at most {limit} per request are served",
            field,
        )
    return count


@dataclass(frozen=True)
class ChoiceRequest:
    """One engine request of the fan-out."""

    prompt_index: int
    sequence: int  # 0 = the prompt's leader
    prompt_token_ids: list[int]
    params: SamplingParams

    @property
    def leader(self) -> bool:
        return self.sequence == 0


def plan_choices(
    body: CompletionRequest | ChatCompletionRequest, prepared: list[PreparedRequest]
) -> list[ChoiceRequest]:
    """The engine requests for ``prepared`` (one per prompt), in choice order."""
    sequences = body.num_sequences
    # best_of ranks sequences by cumulative logprob: the engine must report the sampled tokens'
    ranked = sequences > body.n
    out = []
    for p, prep in enumerate(prepared):
        for i in range(sequences):
            params = prep.params
            params = replace(
                params,
                seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,  # (shared)
                logprobs=0 if ranked and params.logprobs is None else params.logprobs,
            )
            out.append(ChoiceRequest(p, i, prep.prompt_token_ids, params))
    return out


def prompt_info(
    body: CompletionRequest | ChatCompletionRequest,
    prompt_index: int,
    token_ids: list[int],
    tokenizer: Tokenizer | None,
) -> PromptInfo | None:
    """What the choices of prompt ``prompt_index`` echo or report of it (None: nothing)."""
    echo = isinstance(body, CompletionRequest) and body.echo
    if not echo and body.prompt_logprobs is None:
        return None

    def decode(ids: list[int]) -> str:
        if tokenizer is None:
            raise RuntimeError("echo needs the model's tokenizer")
        return tokenizer.decode(ids, skip_special_tokens=False)

    text = ""
    if echo:
        assert isinstance(body, CompletionRequest)
        prompt = body.prompts()[prompt_index]
        text = prompt if isinstance(prompt, str) else decode(prompt)
    return PromptInfo(text, token_ids, decode(token_ids[:1]))


def set_prompt(
    formatter: ResponseFormatter,
    body: CompletionRequest | ChatCompletionRequest,
    prompt: PromptInfo | None,
) -> ResponseFormatter:
    """``formatter`` rendering ``prompt`` as ``body`` asks (echo, prompt_logprobs)."""
    formatter.prompt = prompt
    formatter.want_prompt_logprobs = body.prompt_logprobs is not None
    if isinstance(formatter, CompletionFormatter) and isinstance(body, CompletionRequest):
        formatter.echo = body.echo
    return formatter
