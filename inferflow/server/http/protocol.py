"""OpenAI request bodies for ``/v1/completions`` and ``/v1/chat/completions``.

Parsing turns any schema problem into a 400 naming the field (``param``), the way OpenAI does.
Nothing is silently ignored: an unknown request field is a 400 naming it, and parameters we
cannot honour (``store``, ``suffix``, ...) are accepted only at their neutral value. ``n``,
``best_of`` (completions, not streamed), ``echo`` and several prompts per completion request are
served by fanning the request out (``choices.py``). (Inside a chat message, extra keys such as
``refusal`` or ``annotations`` of an echoed assistant message are dropped: they do not change the
prompt.) vLLM extensions honoured: ``top_k``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``priority``, ``repetition_penalty``, ``min_p``, ``prompt_logprobs``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, StrictInt, ValidationError

from inferflow.json_types import JSONValue
from inferflow.models.generation_config import GenerationDefaults
from inferflow.sampling_params import MAX_N, SamplingParams, SamplingParamsError
from inferflow.server.http.errors import OpenAIError, bad_request, field_path
from inferflow.server.http.guided_fields import ClosedModel, GuidedFields
from inferflow.server.http.tool_calls import ToolCall, ToolFields

MAX_STOP_SEQUENCES = 4
BaseModelT = TypeVar("BaseModelT", bound=BaseModel)


class StreamOptions(ClosedModel):
    include_usage: bool = False


# OpenAI fields accepted only at their neutral value: (field, allowed values, why not others)
NEUTRAL_ONLY: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("store", (None, False), "this server does not store completions (store must be false)"),
    ("metadata", (None, {}), "metadata is only kept with store, which this server does not do"),
    ("service_tier", (None, "auto", "default"), "service_tier must be auto or default"),
)


class _SamplingFields(GuidedFields, ClosedModel):
    """Fields both endpoints share (structured output: ``GuidedFields``)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = Field(
        default=None, json_schema_extra={"maxItems": MAX_STOP_SEQUENCES}
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices per prompt
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = None
    # token id (as a string, OpenAI's form) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, json_schema_extra={"propertyNames": {"pattern": "^[0-9]+$"}}
    )
    # accepted only at their neutral value (the OpenAPI document says so; anything else is a 400)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM extensions
    top_k: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    priority: int = 0
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # vLLM: each prompt token's logprob and this many top alternatives (not streamed)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is not available when stream is true",
                              "prompt_logprobs")
        for name, allowed, why in NEUTRAL_ONLY:
            if getattr(self, name) not in allowed:
                raise bad_request(why, name)
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", "stop")
        if any(s == "" for s in stops):
            raise bad_request("stop sequences must be non-empty strings", "stop")

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, defaults: GenerationDefaults | None = None
    ) -> SamplingParams:
        """SamplingParams for this request; range errors become a 400 naming the field. A field
        the request leaves unset takes the model's generation-config default (``defaults``),
        else the neutral one (temperature 1, top_p 1, top_k off)."""
        model = defaults or GenerationDefaults()
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=_first(self.temperature, model.get("temperature", 1.0)),
                top_p=_first(self.top_p, model.get("top_p", 1.0)),
                top_k=_first(self.top_k, model.get("top_k", 0)),
                seed=self.seed,
                stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                min_tokens=self.min_tokens,
                guided=self.guided(),
                presence_penalty=_first(self.presence_penalty, 0.0),
                frequency_penalty=_first(self.frequency_penalty, 0.0),
                repetition_penalty=_first(self.repetition_penalty,
                                          model.get("repetition_penalty", 1.0)),
                min_p=_first(self.min_p, model.get("min_p", 0.0)),
                logit_bias=self.token_biases(),
                prompt_logprobs=self.engine_prompt_logprobs,
            )
        except SamplingParamsError as exc:
            raise bad_request(str(exc), self._param_name(exc.field)) from None

    def _param_name(self, sampling_field: str) -> str:
        return sampling_field

    def token_biases(self) -> dict[int, float] | None:
        """``logit_bias`` with token-id keys; a key that is not a token id is a 400 naming it
        (an id past the vocabulary is refused by the engine, which knows the vocabulary)."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, bias in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
            biases[int(key)] = bias
        return biases

    @property
    def num_sequences(self) -> int:
        """Engine requests per prompt: ``best_of`` when set, else ``n``."""
        return self.n

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the engine computes (top alternatives per prompt token)."""
        return self.prompt_logprobs

    def guided(self) -> Any:
        """The request's output constraint (``GuidedConstraint``) or None."""
        return self.guided_constraint()


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt or several (text or token ids), each answered by
    ``n`` choices (the best ``n`` of ``best_of`` when set), in order: choice
    ``prompt_index * n + i``."""

    # strict ints: JSON true/false or 1.0 are not token ids (pydantic's lax mode would take them)
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: the prompt only (with echo)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # the choice's text (and logprobs) start with the prompt's
    suffix: str | None = Field(default=None, json_schema_extra={"maxLength": 0})
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise bad_request(f"best_of must be >= n ({self.n}), got {self.best_of}", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise bad_request("best_of cannot be combined with stream", "best_of")
        self.prompts()

    @property
    def num_sequences(self) -> int:
        return self.best_of or self.n

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """With ``echo`` and ``logprobs``, the prompt tokens' logprobs join the ``logprobs``
        object; ``prompt_logprobs`` asks for them on their own (the larger count wins)."""
        counts = [c for c in (self.prompt_logprobs, self.logprobs if self.echo else None)
                  if c is not None]
        return max(counts) if counts else None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids (a bare string or id list is one prompt); an
        empty prompt list or token-id prompt is a 400."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        if isinstance(p, list) and not p:
            raise bad_request("prompt must not be empty", "prompt")
        for i, item in enumerate(batch):
            if isinstance(item, list) and not item:
                raise bad_request("a token-id prompt must not be empty", f"prompt.{i}")
        return batch  # type: ignore[return-value]

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; a batch of several prompts is a 400."""
        prompts = self.prompts()
        if len(prompts) != 1:
            raise bad_request("one prompt is expected here", "prompt")
        return prompts[0]


class ChatMessage(BaseModel):  # extra keys (an echoed ``refusal``...) are ignored
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an earlier assistant turn that called tools
    tool_call_id: str | None = None  # role "tool": the call this result answers

    def text(self, index: int) -> str:
        """Plain-text content; only ``{"type": "text"}`` parts are accepted."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    "only text content parts are supported", f"messages.{index}.content"
                )
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(ToolFields, _SamplingFields):
    """``POST /v1/chat/completions`` (tools: ``ToolFields``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    modalities: list[Literal["text"]] | None = None  # text only
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        for i, message in enumerate(self.messages):
            if message.role == "tool" and not message.tool_call_id:
                raise bad_request(
                    "a tool message needs the tool_call_id it answers",
                    f"messages.{i}.tool_call_id",
                )
        if self.tool_mode() == "forced" and self.guided_constraint() is not None:
            raise bad_request(
                "tool_choice required or a named tool already constrains the output; "
                "it cannot be combined with response_format or structured_outputs",
                "tool_choice",
            )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict[str, Any]]:
        """The conversation as the chat template sees it (tool calls and results included)."""
        out = []
        for i, m in enumerate(self.messages):
            message: dict[str, Any] = {"role": m.role}
            if m.content is not None:  # null content: no key, as transformers renders it
                message["content"] = m.text(i)
            if m.name is not None:
                message["name"] = m.name
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out

    def guided(self) -> Any:
        """The output constraint: a forced tool call's, else the structured-output fields'."""
        return self.tool_constraint() or self.guided_constraint()

    def _param_name(self, sampling_field: str) -> str:
        return "top_logprobs" if sampling_field == "logprobs" else sampling_field


def _first(value: Any, default: Any) -> Any:
    return default if value is None else value


def parse_body(model: type[_SamplingFields], body: JSONValue) -> Any:
    """Validate a decoded JSON body; the first schema error becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    request.check_supported()
    return request


def validate_body(model: type[BaseModelT], body: JSONValue) -> BaseModelT:
    """``body`` (decoded JSON) as ``model``; a non-object or the first schema error is a 400
    naming its field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> OpenAIError:
    """The first schema error of ``exc`` as a 400 naming its field (a safe, short path)."""
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    # Union members add their type name to the location (e.g. prompt.str); keep the field path.
    path = [p for p in loc if not _is_type_tag(p)]
    param = field_path(path) or None  # (a key the client sent is quoted safely and short)
    message = err["msg"] if param is None else f"{param}: {err['msg']}"
    if err["type"] == "missing":
        message = f"{param} is required"
    elif err["type"] == "extra_forbidden":
        message = f"{param}: unknown or unsupported field (refused rather than ignored)"
    return bad_request(message, param)


def _is_type_tag(part: str) -> bool:
    return part in {
        "str",
        "int",
        "list[str]",
        "list[int]",
        "list[list[int]]",
        "function-after",
    } or (part.startswith(("list[", "dict[", "literal[")))
