"""The ``validator`` slot: reject bad requests before any work is done (HTTP 400 naming the field).

Checks what can be checked before tokenization: exactly one input form, message shapes and roles,
prompt token ids within the vocabulary, sampling ranges, ``max_tokens`` against the context
length and the operator's cap, the number of stop sequences and logprobs. The prompt-length
check needs tokens, so the tokenizer stage does it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferflow.sampling_params import SamplingParamsError
from inferflow.stages.base import RequestStage, StageContext, StageError, StageRequest

DEFAULT_ROLES = ["system", "developer", "user", "assistant", "tool"]


@dataclass
class RequestValidator(RequestStage):
    """Validate a request against the model's limits and this config.

    ``max_tokens_limit``: operator cap on ``max_tokens`` (None = the context length);
    ``max_stop_sequences`` (OpenAI allows 4) of at most ``max_stop_length`` characters each
    (the engine matches them on every step); ``max_logprobs`` (OpenAI allows 20);
    ``max_messages``: messages per chat request; ``allowed_roles``: chat roles accepted.
    """

    max_tokens_limit: int | None = None
    max_stop_sequences: int = 4
    max_stop_length: int = 256
    max_logprobs: int = 20
    max_messages: int = 1024
    allowed_roles: list[str] = field(default_factory=lambda: list(DEFAULT_ROLES))

    def __post_init__(self) -> None:
        self._max_model_len: int | None = None
        self._vocab_size: int | None = None

    def setup(self, context: StageContext) -> None:
        self._max_model_len = context.max_model_len
        self._vocab_size = context.model_config.vocab_size

    def process(self, request: StageRequest) -> StageRequest:
        given = [
            name
            for name in ("prompt", "messages", "prompt_token_ids")
            if getattr(request, name) is not None
        ]
        if len(given) != 1:
            field_name = "messages" if request.messages is not None else "prompt"
            raise StageError(
                field_name,
                f"exactly one of prompt, messages or prompt_token_ids is required, got {given or 'none'}",
            )
        if request.prompt is not None and (
            not isinstance(request.prompt, str) or not request.prompt
        ):
            raise StageError("prompt", "must be a non-empty string")
        if request.messages is not None:
            self._check_messages(request.messages)
        if request.prompt_token_ids is not None:
            self._check_token_ids(request.prompt_token_ids)
        self._check_sampling(request)
        return request

    def _check_messages(self, messages: Any) -> None:
        if not isinstance(messages, list) or not messages:
            raise StageError("messages", "must be a non-empty list of messages")
        if len(messages) > self.max_messages:
            raise StageError(
                "messages", f"at most {self.max_messages} messages are allowed, got {len(messages)}"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise StageError(f"messages[{i}]", "must be an object with 'role' and 'content'")
            role = message.get("role")
            if role not in self.allowed_roles:
                raise StageError(
                    f"messages[{i}].role",
                    f"must be one of {', '.join(self.allowed_roles)}, got {role!r}",
                )
            if message.get("content") is None and role == "assistant":
                continue  # an assistant turn that only called tools (OpenAI: content null)
            _check_content(message.get("content"), f"messages[{i}].content")

    def _check_token_ids(self, ids: Any) -> None:
        if not isinstance(ids, list) or not ids:
            raise StageError("prompt", "token ids must be a non-empty list of integers")
        vocab = self._vocab_size
        for i, t in enumerate(ids):
            if (
                not isinstance(t, int)
                or isinstance(t, bool)
                or t < 0
                or (vocab is not None and t >= vocab)
            ):
                raise StageError(
                    f"prompt[{i}]", f"token id {t!r} is not in the vocabulary [0, {vocab})"
                )

    def _check_sampling(self, request: StageRequest) -> None:
        params = request.sampling_params
        try:
            params.validate()
        except SamplingParamsError as exc:
            raise StageError(exc.field, str(exc).split(": ", 1)[-1]) from None
        limit = self._max_model_len
        if self.max_tokens_limit is not None:
            limit = min(limit or self.max_tokens_limit, self.max_tokens_limit)
        if limit is not None and params.max_tokens > limit:
            raise StageError(
                "max_tokens", f"must be <= {limit} for this model, got {params.max_tokens}"
            )
        if len(params.stop) > self.max_stop_sequences:
            raise StageError(
                "stop",
                f"at most {self.max_stop_sequences} stop sequences are allowed, got {len(params.stop)}",
            )
        longest = max((len(s) for s in params.stop), default=0)
        if longest > self.max_stop_length:
            raise StageError(
                "stop",
                f"a stop sequence may have at most {self.max_stop_length} characters, got {longest}",
            )
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise StageError("logprobs", f"must be <= {self.max_logprobs}, got {params.logprobs}")


def _check_content(content: Any, where: str) -> None:
    """Chat content: a string, or a list of ``{"type": "text", "text": str}`` parts."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise StageError(where, "must be a string or a list of text parts")
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            raise StageError(
                f"{where}[{j}]", "only {'type': 'text', 'text': str} parts are supported"
            )
