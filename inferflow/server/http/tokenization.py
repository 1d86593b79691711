"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, with the served model's tokenizer.

- ``/tokenize`` ``{model, prompt, add_special_tokens=true, return_token_strs=false}`` or
  ``{model, messages, add_generation_prompt=true, continue_final_message=false,
  add_special_tokens=false, tools?, return_token_strs=false}`` -> ``{count, max_model_len,
  tokens, token_strs}`` (``token_strs``: each id's vocabulary entry, or null unless asked).
  Messages go through the checkpoint's chat template as ``/v1/chat/completions`` renders them
  (request-stage plugins that rewrite a conversation, e.g. ``system_prompt``, are not run).
  As in vLLM, the prompt is not checked against the context length: ``count`` and
  ``max_model_len`` let the client do it.
- ``/detokenize`` ``{model, tokens}`` -> ``{prompt}`` (special tokens kept, as vLLM decodes).

``model`` is routed as the completion routes route it (a name, its canary split and sticky key,
or ``name@version``; 404 for an unknown one) and may be left out when one LLM is served. Same
keys as the ``/v1`` routes; no engine work, so no rate-limit charge and no queue slot. Bad input
is a 400 naming the field (an id outside the tokenizer's vocabulary names its index).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    Field,
    RootModel,
    StrictBool,
    StrictInt,
    StrictStr,
)

from inferflow.json_types import JSONValue
from inferflow.server.http.errors import bad_request
from inferflow.server.http.guided_fields import ClosedModel
from inferflow.server.http.json_body import read_json_body
from inferflow.server.http.protocol import ChatCompletionRequest, ChatMessage, validate_body
from inferflow.server.http.tool_calls import ToolDefinition
from inferflow.stages.tokenizer import message_text

if TYPE_CHECKING:
    from inferflow.models.tokenizer import Tokenizer
    from inferflow.server.http.deployments import Deployment
    from inferflow.server.http.frontend import Frontend

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"


class TokenizeCompletionRequest(ClosedModel):
    """``/tokenize`` of a text prompt (vLLM's ``TokenizeCompletionRequest``)."""

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(ClosedModel):
    """``/tokenize`` of a conversation (vLLM's ``TokenizeChatRequest``, ``tools`` included)."""

    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False
    tools: list[ToolDefinition] | None = None


class TokenizeRequest(RootModel[TokenizeCompletionRequest | TokenizeChatRequest]):
    """Either body (the OpenAPI document's; the route picks the chat one when ``messages`` is
    there)."""


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(ClosedModel):
    model: StrictStr | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenization_routes(frontend: Frontend) -> list[tuple[str, Callable[..., Any], list[str]]]:
    """``/tokenize`` and ``/detokenize`` over ``frontend``'s keys and model routing."""

    async def tokenize(request: Request) -> JSONResponse:
        raw = await _read(frontend, request)
        schema: type[TokenizeChatRequest | TokenizeCompletionRequest] = (
            TokenizeChatRequest if isinstance(raw, dict) and "messages" in raw
            else TokenizeCompletionRequest
        )
        body = validate_body(schema, raw)
        deployment = _route(frontend, body.model, request)
        tokenizer = _tokenizer(deployment)
        if isinstance(body, TokenizeChatRequest):
            ids = tokenizer.encode(_render_chat(tokenizer, body), body.add_special_tokens)
        else:
            ids = tokenizer.encode(body.prompt, body.add_special_tokens)
        strs = [tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
        out = TokenizeResponse(count=len(ids), max_model_len=deployment.pipeline.max_model_len,
                               tokens=ids, token_strs=strs)
        return JSONResponse(out.model_dump())

    async def detokenize(request: Request) -> JSONResponse:
        body = validate_body(DetokenizeRequest, await _read(frontend, request))
        tokenizer = _tokenizer(_route(frontend, body.model, request))
        vocab = tokenizer.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"tokens.{bad}: token id {body.tokens[bad]} is not in this "
                              f"model's vocabulary [0, {vocab})", f"tokens.{bad}")
        prompt = tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse(DetokenizeResponse(prompt=prompt).model_dump())

    return [(TOKENIZE_PATH, tokenize, ["POST"]), (DETOKENIZE_PATH, detokenize, ["POST"])]


async def _read(frontend: Frontend, request: Request) -> JSONValue:
    frontend.auth.authenticate(request.headers)
    frontend.check_accepting()
    return await read_json_body(request)


def _route(frontend: Frontend, model: str | None, request: Request) -> Deployment:
    if model is None:
        names = list(frontend.router.by_name)
        if len(names) != 1:
            raise bad_request(f"model is required: this server serves {', '.join(names)}",
                              "model")
        model = names[0]
    return frontend.route(model, request)


def _tokenizer(deployment: Deployment) -> Tokenizer:
    return deployment.pipeline.checkpoint_tokenizer()


def _render_chat(tokenizer: Tokenizer, body: TokenizeChatRequest) -> str:
    """The conversation's prompt text, as the chat route renders it; ``continue_final_message``
    cuts it after the final message's content (transformers' rule), for the model to go on."""
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true "
                          "(set add_generation_prompt to false)", "continue_final_message")
    conversation = ChatCompletionRequest.model_construct(messages=body.messages, tools=body.tools)
    messages = [  # (as the tokenizer stage hands them to the template)
        {**m, "content": message_text(m["content"])} if "content" in m else m
        for m in conversation.message_dicts()
    ]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt,
            tools=conversation.template_tools(),
        )
    except Exception as exc:  # jinja TemplateError / no chat template: client-visible
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
    if not body.continue_final_message:
        return text
    final = str(messages[-1].get("content", ""))
    if final.strip() not in text:
        raise bad_request("continue_final_message: the final message's content is not in the "
                          "rendered conversation", "continue_final_message")
    at = text.rindex(final.strip())
    kept = final.lstrip() if text[at:at + len(final.lstrip())] == final.lstrip() else final.strip()
    return text[: at + len(kept)]
