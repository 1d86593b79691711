"""Tool-call and reasoning parsers (``tool_parser`` / ``reasoning_parser`` slots), unit level.

The readers see the model's output in pieces; whatever the split (every character boundary,
one character at a time), the content and calls they return are those of the whole text, and a
piece once returned is never taken back. The ``auto`` grammars are run by llguidance on the
tiny checkpoint's real tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import llguidance
import pytest

from inferflow.models.tiny import TRAINED
from inferflow.models.tokenizer import Tokenizer
from inferflow.server.http.tool_calls import ToolCallFormatter, chat_formatter, parse_tool_calls
from inferflow.server.messages import RequestUpdate
from inferflow.stages.base import StageContext
from inferflow.stages.call_reader import CallPiece, CallReader, ContentPiece, read_calls
from inferflow.stages.reasoning_parser import (
    AutoReasoningParser,
    NoReasoningParser,
    ThinkReasoningParser,
)
from inferflow.stages.think_reader import ThinkReader, split_reasoning
from inferflow.stages.tool_parser import (
    AutoToolParser,
    HermesToolParser,
    JsonToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    strict_schema,
)

NAMES = {"get_weather", "get_time"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ARGS = '{"city": "Paris", "days": [1, {"x": "}]\\""}]}'
HERMES = HermesToolParser.call_format
LLAMA = Llama3JsonToolParser.call_format
MISTRAL = MistralToolParser.call_format
JSON = JsonToolParser.call_format

# (format, output, expected content, expected [(name, arguments)])
CASES = [
    (HERMES, f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n'
             '</tool_call>', "Let me check.\n", [("get_weather", ARGS)]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n', None,
     [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    (HERMES, "No call: a <tool_ tag and <tool_call> not JSON</tool_call>",
     "No call: a <tool_ tag and <tool_call> not JSON</tool_call>", []),
    (HERMES, '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", '{"city": "Rome"}')]),
    (LLAMA, '<|python_tag|>{"name": "get_time", "parameters": {}}; '
            '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_time", "{}"), ("get_weather", '{"city": "Rome"}')]),
    (LLAMA, 'Use {"name": "get_time"} to ask.', 'Use {"name": "get_time"} to ask.', []),
    (LLAMA, '{"answer": 42}', '{"answer": 42}', []),
    (MISTRAL, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, '
              '{"name": "get_weather", "arguments": {"city": "Nice"}}]', None,
     [("get_time", "{}"), ("get_weather", '{"city": "Nice"}')]),
    (MISTRAL, '[{"name": "get_time", "arguments": {"tz": "UTC"}}]', None,
     [("get_time", '{"tz": "UTC"}')]),
    (JSON, '[{"name": "get_time", "arguments": {}}]', None, [("get_time", "{}")]),
    (JSON, '{"arguments": {"city": "Bern"}, "name": "get_weather"}', None,
     [("get_weather", '{"city": "Bern"}')]),
    (JSON, '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}', None,
     [("get_time", '{"tz": "CET"}')]),
    (JSON, "[1, 2]", "[1, 2]", []),
    (JSON, "  plain text {not json}", "  plain text {not json}", []),
]


def _assemble(events: list[ContentPiece | CallPiece]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", []
    for event in events:
        if isinstance(event, ContentPiece):
            content += event.text
        elif event.id is not None:
            assert event.index == len(calls) and event.arguments == ""
            calls.append([event.name, ""])
        else:
            assert calls and event.index == len(calls) - 1  # arguments of the call just begun
            calls[-1][1] += event.arguments
    return content, [(n, a) for n, a in calls]


def _splits(text: str) -> list[list[str]]:
    """Every two-piece split, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_calls_read_the_same_whatever_the_split(fmt, text, content, calls) -> None:
    whole_content, whole_calls, incomplete = read_calls(fmt, NAMES, text)
    assert not incomplete
    assert whole_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == calls
    for c in whole_calls:
        json.loads(c["function"]["arguments"])
        assert c["id"].startswith("call_") and c["type"] == "function"
    for pieces in _splits(text):
        reader = CallReader(fmt, NAMES)
        events = [e for piece in pieces for e in reader.feed(piece)] + reader.finish()
        streamed_content, streamed_calls = _assemble(events)
        assert streamed_calls == calls, pieces
        assert (streamed_content if streamed_content.strip() or not calls else None) == content
        if calls:  # markers never reach the content
            assert not any(m in streamed_content for m in ("<tool_call>", "[TOOL_CALLS]", '"name"'))


def test_text_before_a_call_is_released_before_the_call_ends() -> None:
    reader = CallReader(HERMES, NAMES)
    assert reader.feed("Checking the weather. <tool") == [ContentPiece("Checking the weather. ")]
    assert reader.feed('_call>\n{"name": "get_we') == []
    head = reader.feed('ather", "arguments": {"ci')
    assert isinstance(head[0], CallPiece) and head[0].name == "get_weather"
    assert [e.arguments for e in head[1:]] == ['{"ci']  # arguments stream as they come
    assert reader.feed('ty": "Rome"}}\n</tool_call>') == [CallPiece(0, None, None, 'ty": "Rome"}')]
    assert reader.finish() == [] and not reader.incomplete


def test_an_answer_that_is_not_a_call_is_released_at_its_first_foreign_key() -> None:
    reader = CallReader(JSON, NAMES)
    assert reader.feed('{"answer": 4') == [ContentPiece('{"answer": 4')]


def test_a_call_cut_short_is_incomplete() -> None:
    content, calls, incomplete = read_calls(
        HERMES, NAMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'
    )
    assert incomplete and calls == [] and content == ""  # (the formatter returns the text)
    assert parse_tool_calls('{"name": "get_time", "arguments": {}}', NAMES) is not None
    assert parse_tool_calls('{"name": "get_time", "arguments": {}} and more', NAMES) is None


THINK_CASES = [  # (output, prompt opened <think>, reasoning, content)
    ("<think>\nLet me see.\n</think>\n\nParis.", False, "\nLet me see.\n", "Paris."),
    ("Let me see.</think>Paris.", True, "Let me see.", "Paris."),
    ("Paris, no thinking.", False, None, "Paris, no thinking."),
    ("<think>cut short", False, "cut short", ""),
    ("a < b </thin", True, "a < b </thin", ""),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), THINK_CASES)
def test_reasoning_splits_the_same_whatever_the_split(text, inside, reasoning, content) -> None:
    assert split_reasoning(ThinkReader(inside=inside), text) == (reasoning, content)
    for pieces in _splits(text):
        reader = ThinkReader(inside=inside)
        out = [p for piece in pieces for p in reader.feed(piece)] + reader.finish()
        assert "".join(t for c, t in out if c == "reasoning") == (reasoning or "")
        assert "".join(t for c, t in out if c == "content") == content
        assert not any("</think>" in t for _, t in out)


def test_strict_closes_every_object_schema_without_touching_the_clients() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "string"}}},
            "c": {"type": "array", "items": {"properties": {"d": {}}}},
            "e": {"anyOf": [{"type": "object"}, {"type": "null"}]},
            "f": {"type": "object", "additionalProperties": True},
        },
        "$defs": {"g": {"type": "object"}},
    }
    before = json.dumps(schema)
    strict = strict_schema(schema)
    assert json.dumps(schema) == before
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["additionalProperties"] is False
    assert strict["properties"]["c"]["items"]["additionalProperties"] is False
    assert strict["properties"]["e"]["anyOf"][0]["additionalProperties"] is False
    assert strict["properties"]["f"]["additionalProperties"] is True  # the client's own choice
    assert strict["$defs"]["g"]["additionalProperties"] is False


# --- the checkpoints' templates ----------------------------------------------------------------
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if tools %}<tools>{{ tools | tojson }}</tools> Answer with "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}{% if tools %}Respond with "
    "{\"name\": function name, \"parameters\": ...} or <|python_tag|>{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def checkpoint_tokenizer(folder: Path, template: str, special: str | None = None) -> Path:
    """The tiny checkpoint's tokenizer with ``template`` (and ``special`` added as a special
    token, id 4096)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TRAINED / "tokenizer.json", folder / "tokenizer.json")
    config = json.loads((TRAINED / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    if special is not None:
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["added_tokens"].append({
            "id": 4096, "content": special, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True,
        })
        (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def _context(folder: Path) -> StageContext:
    return StageContext("m", folder, None, Tokenizer(folder), 2048)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("template", "tool_parser", "reasoning_parser"),
    [
        (QWEN_TEMPLATE, HermesToolParser, ThinkReasoningParser),
        (LLAMA_TEMPLATE, Llama3JsonToolParser, NoReasoningParser),
        ("{{ '[INST]' }}{% if tools %}[TOOL_CALLS]{% endif %}", MistralToolParser, NoReasoningParser),
        (json.loads((TRAINED / "tokenizer_config.json").read_text())["chat_template"],
         JsonToolParser, NoReasoningParser),
    ],
)
def test_auto_is_told_from_the_chat_template(
    tmp_path: Path, template: str, tool_parser: type, reasoning_parser: type
) -> None:
    context = _context(checkpoint_tokenizer(tmp_path, template))
    tools, reasoning = AutoToolParser(), AutoReasoningParser()
    tools.setup(context)
    reasoning.setup(context)
    assert type(tools.resolved) is tool_parser
    assert type(reasoning.resolved) is reasoning_parser


def test_a_prompt_that_opens_think_starts_inside_the_reasoning(tmp_path: Path) -> None:
    folder = checkpoint_tokenizer(tmp_path, QWEN_TEMPLATE)
    parser = ThinkReasoningParser()
    parser.setup(_context(folder))
    tok = Tokenizer(folder)
    opened = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert parser.prompt_opens(opened)
    assert not parser.prompt_opens(tok.encode("<think>\nplan</think>\n", False))


# --- the auto-mode grammars, run by llguidance on the real tokenizer --------------------------
def _matcher(folder: Path, grammar: str, vocab: int = 4096) -> Any:
    tok = llguidance.LLTokenizer(str(folder / "tokenizer.json"), n_vocab=vocab, eos_token=[4])
    matcher = llguidance.LLMatcher(tok, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return tok, matcher


def _accepts(tok: Any, matcher: Any, text: str) -> bool:
    return all(matcher.consume_token(t) for t in tok.tokenize_str(text))


def test_hermes_grammar_leaves_text_free_and_holds_calls_to_the_schema(tmp_path: Path) -> None:
    folder = checkpoint_tokenizer(tmp_path, QWEN_TEMPLATE)
    parser = HermesToolParser()
    parser.setup(_context(folder))
    tools = [("get_weather", strict_schema(WEATHER)), ("get_time", {"type": "object"})]
    grammar = parser.auto_grammar(tools, parallel=False)
    assert grammar is not None
    tok, plain = _matcher(folder, grammar)
    answer = 'def f(x):\n    return {"a": [1, 2]}  # any text, even <tool or {"name": 1}\n'
    assert _accepts(tok, plain, answer) and plain.is_accepting()
    tok, call = _matcher(folder, grammar)
    assert _accepts(tok, call, "Checking.\n<tool_call>")
    assert tok.decode_str(call.compute_ff_tokens()) == '\n{"name": "get_'  # forced
    tok, extra = _matcher(folder, grammar)
    prefix = 'x<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"'
    assert _accepts(tok, extra, prefix)
    assert not _accepts(tok, extra, ', "country": "IT"}}')  # strict: no key it does not list
    tok, done = _matcher(folder, grammar)
    assert _accepts(tok, done, prefix + '}}\n</tool_call>')
    assert done.is_accepting() and not _accepts(tok, done, "\n<tool_call>")  # one call only


def test_a_marker_that_is_a_special_token_is_named_by_its_id(tmp_path: Path) -> None:
    folder = checkpoint_tokenizer(tmp_path, LLAMA_TEMPLATE, special="<|python_tag|>")
    parser = Llama3JsonToolParser()
    parser.setup(_context(folder))
    assert parser.special_token("<|python_tag|>") == 4096
    grammar = parser.auto_grammar([("get_weather", WEATHER)], parallel=True)
    assert grammar is not None and "<[4096]>" in grammar
    tok, matcher = _matcher(folder, grammar, vocab=4097)
    assert matcher.consume_token(4096)
    call = '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
    assert _accepts(tok, matcher, call + call[:-2])
    assert matcher.is_accepting()
    tok, text = _matcher(folder, grammar, vocab=4097)
    assert _accepts(tok, text, "The answer is 4.") and not text.consume_token(4096)


# --- the formatter: OpenAI's chunk shapes ------------------------------------------------------
def _formatter(text_format: Any, reasoning: bool, index: int = 0) -> ToolCallFormatter:
    fmt = ToolCallFormatter(
        "m", False, False, "auto", NAMES, text_format,
        (lambda: ThinkReader(inside=True)) if reasoning else None,
    )
    fmt.index = index  # type: ignore[attr-defined]  # (the n > 1 choice this formatter renders)
    return fmt


def test_streamed_chunks_have_openais_shape(tmp_path: Path) -> None:
    output = ('Plan: weather.</think>Sure.<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Rome"}}\n</tool_call>')
    fmt = _formatter(HERMES, reasoning=True, index=2)
    chunks = []
    for i in range(0, len(output), 5):
        piece = output[i : i + 5]
        last = i + 5 >= len(output)
        update = RequestUpdate("r", text=piece, finish_reason="stop" if last else None)
        chunks += fmt.delta_chunks(update)
    choices = [c["choices"][0] for c in chunks]
    assert all(c["index"] == 2 for c in choices)
    deltas = [c["delta"] for c in choices]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Plan: weather."
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert all(set(c) == {"index", "function"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Rome"}'
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)


def test_the_whole_answer_has_tool_calls_content_and_reasoning() -> None:
    from inferflow.server.http.responses import Accumulated

    fmt = _formatter(HERMES, reasoning=True)
    text = 'Hmm.</think>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    choice = fmt.full(Accumulated(text=text, finish_reason="stop"))["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["reasoning_content"] == "Hmm." and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    cut = fmt.full(Accumulated(text=text[:-20], finish_reason="length"))["choices"][0]
    assert cut["finish_reason"] == "length" and "tool_calls" not in cut["message"]
    assert cut["message"]["content"] == text[len("Hmm.</think>\n"):-20]


def test_a_chat_without_tools_or_reasoning_keeps_the_plain_formatter() -> None:
    plain = chat_formatter("m", False, False, None, set(), AutoToolParser(), NoReasoningParser(), [1])
    assert type(plain).__name__ == "ChatFormatter"
