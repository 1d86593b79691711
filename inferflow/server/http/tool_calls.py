"""OpenAI tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``, ``tool_calls``.

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
  - ``"auto"`` (the default when tools are given): unconstrained; an answer that is a JSON call
    (or array of calls) in that shape, with ``arguments`` or Llama 3's ``parameters``, naming a
    given tool, is returned as ``tool_calls``; anything else is text. (A template-specific call
    syntax, e.g. ``<tool_call>`` tags, is not parsed.)
- The response carries ``message.tool_calls`` (``id``, ``type: "function"``, ``function.name``,
  ``function.arguments`` as a JSON string) with ``finish_reason: "tool_calls"``; a stream sends,
  per call, a ``delta.tool_calls`` chunk with ``index``, ``id`` and ``function.name``, then one
  with the ``function.arguments`` text, then the finish chunk. A constrained call cut short by
  ``max_tokens`` is returned as text with ``finish_reason: "length"``.
- ``role: "tool"`` messages (``tool_call_id``) and assistant messages with ``tool_calls`` are
  accepted in the conversation and handed to the template.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inferflow.json_types import JSONObject
from inferflow.sampling_params import GuidedConstraint
from inferflow.server.http.errors import bad_request
from inferflow.server.http.responses import Accumulated, ChatFormatter
from inferflow.server.messages import RequestUpdate

ToolMode = Literal["forced", "auto"]


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Forbid):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Forbid):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Forbid):
    name: str


class NamedToolChoice(_Forbid):
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
            return GuidedConstraint.json_schema(_call_schema(function), "tool_choice")
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": [_call_schema(f) for f in by_name.values()]},
        }
        if self.parallel_tool_calls is False:
            calls["maxItems"] = 1
        return GuidedConstraint.json_schema(calls, "tool_choice")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """``tools`` as the chat template sees them (OpenAI's JSON shape)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _call_schema(function: FunctionDefinition) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            "arguments": function.parameters or {"type": "object"},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def parse_tool_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    """The calls in ``text`` (a JSON call or array of calls naming known tools), else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters"))
        if not isinstance(args, dict):
            return None
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": item["name"],
                    "arguments": json.dumps(args, ensure_ascii=False),
                },
            }
        )
    return calls or None


class ToolCallFormatter(ChatFormatter):
    """Chat responses that may be tool calls (``mode``: forced by a constraint, or auto-detected).

    The answer's text is held back while it may still become a call (always when forced; in
    auto mode while it starts like JSON), so a call is never streamed as text first.
    """

    def __init__(
        self, model: str, include_usage: bool, want_logprobs: bool, mode: ToolMode, names: set[str]
    ) -> None:
        super().__init__(model, include_usage, want_logprobs)
        self.mode = mode
        self.names = names
        self._held = ""  # text not sent yet
        self._holding = True

    def take_held_text(self) -> str:
        held, self._held = self._held, ""
        return held

    def delta_chunks(self, update: RequestUpdate) -> list[JSONObject]:
        if not self._holding:
            return super().delta_chunks(update)
        self._held += update.text
        if self.mode == "auto" and self._held.strip() and self._held.lstrip()[0] not in "{[":
            self._holding = False  # plain text after all: send what was held, then stream
            held, self._held = self._held, ""
            return super().delta_chunks(_with_text(update, held))
        if update.finish_reason is None:
            return []
        calls = parse_tool_calls(self._held, self.names) if update.finish_reason == "stop" else None
        held, self._held = self._held, ""
        if calls is None:  # not a call (or cut short): the text, as it is
            return super().delta_chunks(_with_text(update, held))
        chunks = []
        for index, call in enumerate(calls):
            head: JSONObject = {
                "index": index,
                "id": call["id"],
                "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""},
            }
            arguments: JSONObject = {
                "index": index,
                "function": {"arguments": call["function"]["arguments"]},
            }
            for piece in (head, arguments):
                chunks.append(
                    self.chunk(
                        {
                            "index": 0,
                            "delta": {"tool_calls": [piece]},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                )
        chunks.append(
            self.chunk({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"})
        )
        return chunks

    def _full_choice(self, acc: Accumulated) -> JSONObject:
        choice = super()._full_choice(acc)
        calls = parse_tool_calls(acc.text, self.names) if acc.finish_reason == "stop" else None
        if calls is not None:
            choice["message"] = {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [*calls],
            }
            choice["finish_reason"] = "tool_calls"
        return choice


def _with_text(update: RequestUpdate, text: str) -> RequestUpdate:
    return replace(update, text=text)
