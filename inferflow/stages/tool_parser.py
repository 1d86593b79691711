"""The ``tool_parser`` slot: how the served model writes tool calls, read back as ``tool_calls``.

A chat template shows ``tools`` to the model in its own syntax, and the model answers with calls
in that syntax. The slot's stage knows one syntax (:class:`~inferflow.stages.call_reader.CallFormat`):

=================  ==============================================================================
``hermes``         ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or several
                   (Qwen2.5, Qwen3, Hermes)
``llama3_json``    optional ``<|python_tag|>``, then ``{"name": ..., "parameters": {...}}`` at the
                   start of the answer; several separated by ``;`` (Llama 3.1+)
``mistral``        ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (the marker is a
                   special token, dropped from the text: an answer starting with ``[`` is read too)
``json``           a bare JSON call or array of calls as the whole answer (any template)
``auto``           (the default) told from the checkpoint's chat template: ``<tool_call>`` ->
                   hermes, ``<|python_tag|>`` -> llama3_json, ``[TOOL_CALLS]`` -> mistral, else json
=================  ==============================================================================

Contract (:class:`ToolParserStage`), in the API process, for ``/v1/chat/completions`` requests
with ``tools``:

- :meth:`setup` once per process with the model's :class:`~inferflow.stages.base.StageContext`
  (``auto`` reads the chat template there; markers that are special tokens are looked up).
- :meth:`reader` per request: a :class:`~inferflow.stages.call_reader.CallReader`, fed the output
  as it arrives (streamed and not), returning content and call pieces in order.
- :meth:`auto_grammar` per ``tool_choice: "auto"`` request: a Lark grammar (llguidance) that
  leaves the answer free until a call's opening marker, then holds the call to one of the
  tools' schemas (``tools[].function.strict``: extra keys refused). None: no constraint.

A plugin registers its own syntax with ``tool_parser._target_=my_pkg.MyParser`` (a subclass
that sets :attr:`ToolParserStage.call_format` and, for constrained arguments, overrides
:meth:`ToolParserStage.auto_grammar`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from inferflow.stages.call_reader import CallFormat, CallReader

if TYPE_CHECKING:
    from inferflow.models.tokenizer import Tokenizer
    from inferflow.stages.base import StageContext

# A tool as the grammar needs it: (name, its parameters' JSON schema).
ToolSchema = tuple[str, dict[str, Any]]
# llguidance's compact JSON (what clients parse; the guided slot's default)
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TEXT = r"/(.|\n)*/"  # any text
_SP = r"/[ \t\r\n]+/"  # what may stand before a call that opens the answer


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` whose object schemas refuse keys they do not list
    (``"additionalProperties": false`` where it is not set), at every depth."""
    out = copy.deepcopy(schema)
    _close_objects(out)
    return out


def _close_objects(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _close_objects(item)
        return
    if not isinstance(node, dict):
        return
    if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
        node["additionalProperties"] = False
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            if isinstance(value, dict):
                for sub in value.values():
                    _close_objects(sub)
        elif key in ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "additionalProperties",
                     "if", "then", "else", "contains"):
            _close_objects(value)


def after_reasoning(grammar: str, end: str) -> str:
    """``grammar`` (its ``start`` rule) allowed after a reasoning block that ``end`` closes: the
    reasoning is free text (opened in the prompt or in the output), the answer is constrained."""
    answer = grammar.replace("\nstart: ", "\nanswer: ", 1)
    assert answer != grammar, "the grammar has no start rule"
    return (
        f"{answer}start: answer | thought answer\n"
        f"thought[lazy]: ANY {json.dumps(end)}\n"
        f"ANY: {_TEXT}\n"
    )


def call_schema(name: str, parameters: dict[str, Any], arguments_key: str = "arguments") -> dict:
    """The JSON schema of one call of ``name`` (``name`` first, so it is generated first)."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _calls_json(tools: Sequence[ToolSchema], arguments_key: str) -> str:
    """``%json`` of a call of any of ``tools`` (compact JSON)."""
    calls = [call_schema(name, params, arguments_key) for name, params in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_STYLE})


@dataclass
class ToolParserStage:
    """Contract of the ``tool_parser`` slot (see the module docstring)."""

    kind: ClassVar[str] = "tool_parser"
    option: ClassVar[str] = ""  # the built-in option name (``tool_parser=...``)
    call_format: ClassVar[CallFormat] = CallFormat(bare="{[", separators="[,]")
    arguments_key: ClassVar[str] = "arguments"

    def setup(self, context: StageContext) -> None:
        """Once per process: the served model (the default keeps its tokenizer)."""
        self._tokenizer: Tokenizer | None = context.tokenizer

    @property
    def resolved(self) -> ToolParserStage:
        """The parser in effect (``auto``: the one its template chose)."""
        return self

    def reader(self, names: set[str]) -> CallReader:
        return CallReader(self.call_format, names)

    def auto_grammar(self, tools: Sequence[ToolSchema], parallel: bool) -> str | None:
        """The Lark grammar of a ``tool_choice: "auto"`` answer, or None (unconstrained)."""
        return None

    def special_token(self, marker: str | None) -> int | None:
        """The id of ``marker`` when the tokenizer has it as one special token (the detokenizer
        drops such tokens from the text; a grammar names them as ``<[id]>``)."""
        tok = getattr(self, "_tokenizer", None)
        if tok is None or marker is None:
            return None
        token_id = tok.token_to_id(marker)
        if token_id is None or tok.decode([token_id], skip_special_tokens=True):
            return None
        return token_id


@dataclass
class JsonToolParser(ToolParserStage):
    """A bare JSON call (or array of calls) as the whole answer."""

    option: ClassVar[str] = "json"

    def auto_grammar(self, tools: Sequence[ToolSchema], parallel: bool) -> str | None:
        call = _calls_json(tools, self.arguments_key)
        calls = '"[" call (", " call)* "]"' if parallel else 'call'
        return (
            "%llguidance {}\n"
            f"start: TEXT | SP? {calls}\n"
            f"call: {call}\n"
            f"SP: {_SP}\n"
            # text that does not open with { or [ (an answer that does is a call)
            r"TEXT: /\s*|\s*[^{\[\s](.|\n)*/" + "\n"
        )


@dataclass
class HermesToolParser(ToolParserStage):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5/Qwen3)."""

    option: ClassVar[str] = "hermes"
    call_format: ClassVar[CallFormat] = CallFormat(opener="<tool_call>", closer="</tool_call>")

    def auto_grammar(self, tools: Sequence[ToolSchema], parallel: bool) -> str | None:
        opener, closer = "<tool_call>", "</tool_call>"
        special = self.special_token(opener)
        if special is not None:
            head, more = f"head: TEXT <[{special}]>", f'"\\n" <[{special}]> block'
        else:  # a lazy lexeme: the free text ends as soon as the marker is written
            head, more = f"head[lazy]: TEXT {json.dumps(opener)}", f'{json.dumps(chr(10) + opener)} block'
        repeat = f" ({more})*" if parallel else ""
        return (
            "%llguidance {}\n"
            f"start: TEXT | head block{repeat}\n"
            f"{head}\n"
            f'block: "\\n" {_calls_json(tools, self.arguments_key)} {json.dumps(chr(10) + closer)}\n'
            f"TEXT: {_TEXT}\n"
        )


@dataclass
class Llama3JsonToolParser(ToolParserStage):
    """Llama 3.1+ JSON calls: ``[<|python_tag|>]{"name": ..., "parameters": {...}}[; ...]``."""

    option: ClassVar[str] = "llama3_json"
    call_format: ClassVar[CallFormat] = CallFormat(opener="<|python_tag|>", bare="{", separators=";")
    arguments_key: ClassVar[str] = "parameters"

    def auto_grammar(self, tools: Sequence[ToolSchema], parallel: bool) -> str | None:
        special = self.special_token("<|python_tag|>")
        tagged = f" | <[{special}]> calls" if special is not None else ""
        repeat = ' ("; " call)*' if parallel else ""
        return (
            "%llguidance {}\n"
            f"start: TEXT | SP? calls{tagged}\n"
            f"calls: call{repeat}\n"
            f"call: {_calls_json(tools, self.arguments_key)}\n"
            f"SP: {_SP}\n"
            r"TEXT: /\s*|\s*[^{\s](.|\n)*/" + "\n"  # an answer that opens with { is a call
        )


@dataclass
class MistralToolParser(ToolParserStage):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral)."""

    option: ClassVar[str] = "mistral"
    call_format: ClassVar[CallFormat] = CallFormat(
        opener="[TOOL_CALLS]", bare="[", separators="[,]"
    )

    def auto_grammar(self, tools: Sequence[ToolSchema], parallel: bool) -> str | None:
        marker = "[TOOL_CALLS]"
        special = self.special_token(marker)
        head = f"head: TEXT <[{special}]>" if special is not None else (
            f"head[lazy]: TEXT {json.dumps(marker)}"
        )
        calls = '"[" call (", " call)* "]"' if parallel else '"[" call "]"'
        return (
            "%llguidance {}\n"
            f"start: TEXT | head {calls}\n"
            f"{head}\n"
            f"call: {_calls_json(tools, self.arguments_key)}\n"
            f"TEXT: {_TEXT}\n"
        )


TOOL_PARSERS: dict[str, type[ToolParserStage]] = {
    cls.option: cls
    for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, JsonToolParser)
}
# what a chat template's text says about its call syntax, checked in this order
_TEMPLATE_MARKERS = (
    ("<tool_call>", HermesToolParser),
    ("<|python_tag|>", Llama3JsonToolParser),
    ("[TOOL_CALLS]", MistralToolParser),
)


def template_text(tokenizer: Tokenizer | None) -> str:
    """Every chat template of the checkpoint, as one text ("" without any)."""
    templates = getattr(tokenizer, "chat_templates", None)
    if isinstance(templates, dict):
        return "\n".join(templates.values())
    return templates or ""


@dataclass
class AutoToolParser(ToolParserStage):
    """The parser the checkpoint's chat template calls for (see the module docstring)."""

    option: ClassVar[str] = "auto"

    def __post_init__(self) -> None:
        self._chosen: ToolParserStage = JsonToolParser()

    def setup(self, context: StageContext) -> None:
        super().setup(context)
        text = template_text(context.tokenizer)
        cls = next((c for marker, c in _TEMPLATE_MARKERS if marker in text), JsonToolParser)
        self._chosen = cls()
        self._chosen.setup(context)

    @property
    def resolved(self) -> ToolParserStage:
        return self._chosen

    def reader(self, names: set[str]) -> CallReader:
        return self._chosen.reader(names)

    def auto_grammar(self, tools: Sequence[ToolSchema], parallel: bool) -> str | None:
        return self._chosen.auto_grammar(tools, parallel)
