"""OpenAI tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``, ``tool_calls``;
and the reasoning of reasoning models (``reasoning_content``).

What is supported:

- ``tools`` (functions with a JSON-schema ``parameters``) reach the prompt through the
  checkpoint's chat template, as its ``tools`` variable (transformers' convention). A template
  that does not use ``tools`` does not show them to the model; the constraints below still hold.
- ``tool_choice``:
  - ``"none"``: the model answers in text;
  - ``"required"``: the output is constrained (the ``guided`` stage) to a JSON array of one or
    more calls ``{"name": <a tool>, "arguments": <matching its parameters>}``; one at most when
    ``parallel_tool_calls`` is false;
  - ``{"type": "function", "function": {"name": F}}``: constrained to one call of ``F``;
  - ``"auto"`` (the default when tools are given): the answer is free text or calls in the
    template's own syntax, read by the ``tool_parser`` slot (``inferflow/stages/tool_parser.py``:
    hermes ``<tool_call>``, llama3_json, mistral ``[TOOL_CALLS]``, json; ``auto`` picks it from
    the chat template). With ``guided=llguidance`` the answer is constrained once a call opens:
    the call names one of the tools and its arguments follow that tool's schema; the text
    before it is not constrained.
- ``tools[].function.strict: true`` (and always with ``"required"`` or a named tool): the
  arguments' objects accept no key their schema does not list (``"additionalProperties": false``
  added where the schema sets nothing).
- The response carries ``message.tool_calls`` (``id``, ``type: "function"``, ``function.name``,
  ``function.arguments`` as a JSON string) with ``finish_reason: "tool_calls"`` and ``content``:
  the text outside the calls, or null. A stream sends text before a call as ``delta.content`` at
  once (only a possible marker's start is held), then per call a ``delta.tool_calls`` chunk with
  ``index``, ``id``, ``type`` and ``function.name`` (``arguments: ""``), then the arguments'
  JSON text in pieces as it is generated; markers never reach ``content``. A call cut short by
  ``max_tokens`` is returned as text with ``finish_reason: "length"`` (a stream has sent its
  pieces by then).
- ``reasoning_parser`` (``inferflow/stages/reasoning_parser.py``): ``<think>...</think>`` goes
  to ``message.reasoning_content`` / ``delta.reasoning_content``, the answer (and its calls)
  is read from the rest.
- ``role: "tool"`` messages (``tool_call_id``) and assistant messages with ``tool_calls`` are
  accepted in the conversation and handed to the template.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from inferflow.json_types import JSONObject
from inferflow.sampling_params import GuidedConstraint, GuidedKind
from inferflow.server.http.errors import bad_request
from inferflow.server.http.guided_fields import ClosedModel
from inferflow.server.http.responses import Accumulated, ChatFormatter
from inferflow.server.messages import RequestUpdate
from inferflow.stages.call_reader import (
    CallFormat,
    CallPiece,
    CallReader,
    ContentPiece,
    read_calls,
)
from inferflow.stages.reasoning_parser import ReasoningParserStage
from inferflow.stages.think_reader import ThinkReader, split_reasoning
from inferflow.stages.tool_parser import (
    JsonToolParser,
    ToolParserStage,
    ToolSchema,
    after_reasoning,
    call_schema,
    strict_schema,
)

ToolMode = Literal["forced", "auto"]


class FunctionDefinition(ClosedModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(ClosedModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(ClosedModel):
    name: str


class NamedToolChoice(ClosedModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call in an assistant message of the conversation (sent back by the client)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolFields(BaseModel):
    """Mixed into ``ChatCompletionRequest``."""

    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_mode(self) -> ToolMode | None:
        """How the answer is read: constrained to calls, detected, or plain text (None)."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
            return None
        if self.tool_choice == "none":
            return None
        return "auto" if self.tool_choice in (None, "auto") else "forced"

    def tool_names(self) -> set[str]:
        return {t.function.name for t in self.tools or ()}

    def tool_constraint(self) -> GuidedConstraint | None:
        """The output constraint of ``required`` or a named tool (None otherwise)."""
        choice = self.tool_choice
        if not self.tools or choice in (None, "none", "auto"):
            return None
        by_name = {t.function.name: t.function for t in self.tools}
        if isinstance(choice, NamedToolChoice):
            function = by_name.get(choice.function.name)
            if function is None:
                raise bad_request(
                    f"tool_choice names {choice.function.name!r}, which is not in tools "
                    f"({', '.join(sorted(by_name))})",
                    "tool_choice.function.name",
                )
            return GuidedConstraint.json_schema(_call_schema(function, strict=True), "tool_choice")
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(f, strict=True) for f in by_name.values()]},
        }
        if self.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return GuidedConstraint.json_schema(calls, "tool_choice")

    def auto_tool_constraint(
        self, parser: ToolParserStage, reasoning_end: str | None = None
    ) -> GuidedConstraint | None:
        """``tool_choice: "auto"``: the parser's grammar (free text, then calls that follow the
        tools' schemas; after a reasoning block closed by ``reasoning_end`` when the model
        reasons), or None (no tools in auto mode, or a parser without one). The caller applies
        it to a request that asks for no other constraint (``response_format`` wins)."""
        if self.tool_mode() != "auto":
            return None
        tools: list[ToolSchema] = [
            (t.function.name, _parameters(t.function, bool(t.function.strict)))
            for t in self.tools or ()
        ]
        grammar = parser.auto_grammar(tools, parallel=self.parallel_tool_calls is not False)
        if grammar is None:
            return None
        if reasoning_end is not None:
            grammar = after_reasoning(grammar, reasoning_end)
        return GuidedConstraint(GuidedKind.GRAMMAR, grammar, "tools")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template sees them (OpenAI's JSON shape)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _parameters(function: FunctionDefinition, strict: bool) -> dict[str, Any]:
    params = function.parameters or {"type": "object"}
    return strict_schema(params) if strict else params


def _call_schema(function: FunctionDefinition, strict: bool = False) -> dict[str, Any]:
    return call_schema(function.name, _parameters(function, strict or bool(function.strict)))


def parse_tool_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """The calls in ``text`` when it is a bare JSON call or array of calls naming known tools
    (nothing else), else None."""
    content, calls, incomplete = read_calls(JsonToolParser.call_format, names, text)
    return calls if calls and content is None and not incomplete else None


# the tool_choice "required" / named-tool output: a JSON array of calls, or one call
FORCED_FORMAT = JsonToolParser.call_format


class ToolCallFormatter(ChatFormatter):
    """Chat responses read by the parsers: tool calls (``mode``: forced by a constraint, or
    auto-detected in the ``call_format`` syntax) and/or reasoning (``reasoning``: a factory of
    the request's reasoning reader). Streamed and whole answers come from the same readers.
    """

    def __init__(
        self,
        model: str,
        include_usage: bool,
        want_logprobs: bool,
        mode: ToolMode | None,
        names: set[str],
        call_format: CallFormat | None = None,
        reasoning: Callable[[], ThinkReader | None] | None = None,
    ) -> None:
        super().__init__(model, include_usage, want_logprobs)
        self.mode = mode
        self.names = names
        self.call_format = FORCED_FORMAT if mode == "forced" or call_format is None else call_format
        self._new_reasoning = reasoning or (lambda: None)
        self._thinks = self._new_reasoning() is not None
        self._reasoning = self._new_reasoning()
        self._calls = CallReader(self.call_format, names) if mode is not None else None
        self._ended = False

    @property
    def _choice_index(self) -> int:
        return getattr(self, "index", 0)

    # --- streaming ----------------------------------------------------------------------------
    def _read(self, text: str, final: bool) -> list[tuple[str, Any]]:
        """(``reasoning_content`` | ``content`` | ``tool_calls``, value) pieces, in order."""
        if self._ended:
            return []
        self._ended = final
        pieces = [("content", text)] if self._reasoning is None else (
            self._reasoning.feed(text) + (self._reasoning.finish() if final else [])
        )
        out: list[tuple[str, Any]] = []
        for channel, piece in pieces:
            if channel == "reasoning":
                out.append(("reasoning_content", piece))
            elif self._calls is None:
                out.append(("content", piece))
            else:
                out += [_delta_item(e) for e in self._calls.feed(piece)]
        if final and self._calls is not None:
            out += [_delta_item(e) for e in self._calls.finish()]
        return [(k, v) for k, v in out if v]

    def take_held_text(self) -> str:
        return "".join(v for k, v in self._read("", final=True) if k == "content")

    def delta_chunks(self, update: RequestUpdate) -> list[JSONObject]:
        final = update.finish_reason is not None
        choices = [self._piece_choice({key: value}) for key, value in self._read(update.text, final)]
        if (update.logprobs or final) and not choices:
            choices.append(self._piece_choice({}))
        if update.logprobs:
            choices[0]["logprobs"] = self._logprobs(update.logprobs)
        if final:
            choices[-1]["finish_reason"] = self._finish_reason(update.finish_reason)
        return [self.chunk(choice) for choice in choices]

    def _piece_choice(self, delta: JSONObject) -> JSONObject:
        return {"index": self._choice_index, "delta": delta, "logprobs": None, "finish_reason": None}

    def _finish_reason(self, reason: str | None) -> str | None:
        calls = self._calls
        if reason == "stop" and calls is not None and calls.complete_calls and not calls.incomplete:
            return "tool_calls"
        return reason

    # --- whole answers ------------------------------------------------------------------------
    def _full_choice(self, acc: Accumulated) -> JSONObject:
        choice = super()._full_choice(acc)
        message = choice["message"]
        assert isinstance(message, dict)
        reader = self._new_reasoning()
        text = acc.text
        if reader is not None:
            reasoning, text = split_reasoning(reader, acc.text)
            message["content"], message["reasoning_content"] = text, reasoning
        if self.mode is None:
            return choice
        content, calls, incomplete = read_calls(self.call_format, self.names, text)
        if calls and not incomplete:
            message["content"] = content
            message["tool_calls"] = [*calls]
            if acc.finish_reason == "stop":
                choice["finish_reason"] = "tool_calls"
        return choice


def _delta_item(event: ContentPiece | CallPiece) -> tuple[str, Any]:
    if isinstance(event, ContentPiece):
        return ("content", event.text)
    call: JSONObject = {"index": event.index}
    if event.id is not None:
        call.update(
            id=event.id, type="function", function={"name": event.name, "arguments": ""}
        )
    else:
        call["function"] = {"arguments": event.arguments}
    return ("tool_calls", [call])


def chat_formatter(
    model: str,
    include_usage: bool,
    want_logprobs: bool,
    mode: ToolMode | None,
    names: set[str],
    tool_parser: ToolParserStage | None,
    reasoning_parser: ReasoningParserStage | None,
    prompt_token_ids: Sequence[int] | None,
) -> ChatFormatter:
    """The formatter of one chat request: plain, or read by the parsers it needs."""
    def reasoning() -> ThinkReader | None:
        return None if reasoning_parser is None else reasoning_parser.reader(prompt_token_ids)

    if mode is None and reasoning() is None:
        return ChatFormatter(model, include_usage, want_logprobs)
    fmt = tool_parser.resolved.call_format if tool_parser is not None else None
    return ToolCallFormatter(model, include_usage, want_logprobs, mode, names, fmt, reasoning)
