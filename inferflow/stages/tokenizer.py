"""The ``tokenizer`` slot: text or chat messages -> prompt token ids (the checkpoint's tokenizer).

Also the first place where the prompt length is known, so it enforces the context length:
``prompt tokens + max_tokens <= max_model_len`` (OpenAI's ``context_length_exceeded``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferflow.stages.base import RequestStage, StageContext, StageError, StageRequest

if TYPE_CHECKING:
    from inferflow.models.tokenizer import Tokenizer


def message_text(content: Any) -> str:
    """Chat content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


@dataclass
class CheckpointTokenizer(RequestStage):
    """Encode with the checkpoint's ``tokenizer.json``; chat goes through its chat template.

    ``add_special_tokens``: add to completion prompts the special tokens tokenizer.json's
    post-processor places (BOS for Llama 3), as transformers' ``encode`` does.
    """

    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._tokenizer: Tokenizer | None = None
        self._max_model_len = 0

    def setup(self, context: StageContext) -> None:
        self._tokenizer = context.tokenizer
        self._max_model_len = context.max_model_len

    def process(self, request: StageRequest) -> StageRequest:
        tok = self._tokenizer
        if tok is None:
            raise RuntimeError(f"stage {self.name!r}: process() called before setup()")
        field_name = "messages" if request.messages is not None else "prompt"
        if request.prompt_token_ids is None:
            if request.messages is not None:
                messages = [  # (a message without content keeps none: tool-call turns)
                    {**m, "content": message_text(m["content"])} if m.get("content") is not None
                    else {k: v for k, v in m.items() if k != "content"}
                    for m in request.messages
                ]
                try:
                    request.prompt_token_ids = tok.encode_chat(messages, tools=request.tools)
                except Exception as exc:  # jinja TemplateError / no chat template: client-visible
                    raise StageError("messages", f"cannot apply the chat template: {exc}") from None
            elif request.prompt is not None:
                request.prompt_token_ids = tok.encode(request.prompt, self.add_special_tokens)
            else:
                raise StageError("prompt", "a prompt, messages or prompt token ids are required")
        n_prompt, max_tokens = len(request.prompt_token_ids), request.sampling_params.max_tokens
        limit = self._max_model_len
        if n_prompt + max_tokens > limit:
            raise StageError(
                field_name,
                f"this model's maximum context length is {limit} tokens, but {n_prompt + max_tokens} "
                f"were requested ({n_prompt} in the {field_name}, {max_tokens} in the completion); "
                "reduce the length of the input or max_tokens",
                code="context_length_exceeded",
            )
        return request
