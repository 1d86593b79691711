"""Structured output and tool calling through the real server and the ``openai`` client.

The shared server runs the default graph (``guided=llguidance``) on the random-weight tiny
model, whose free output is never valid JSON: at temperature 1.0 over many seeds every
constrained answer must still parse and validate.
"""

from __future__ import annotations

import json
import re
import secrets
import time

import jsonschema
import openai
import pytest
from server_harness import MODEL, ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.xdist_group("torch_server")]

SEEDS = range(6)
PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["zip"],
            "additionalProperties": False,
        },
        "roles": {
            "type": "array",
            "items": {"enum": ["admin", "dev", "ops"]},
            "minItems": 1,
            "maxItems": 2,
        },
        "score": {"type": "number", "minimum": -1, "maximum": 1},
    },
    "required": ["name", "age", "email", "address", "roles"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"enum": ["UTC", "CET"]}},
            "required": ["tz"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {
    "get_weather": WEATHER["function"]["parameters"],
    "get_time": TIME["function"]["parameters"],
}
CHAT = [{"role": "user", "content": "Tell me about someone."}]


def _format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "profile", "schema": schema, "strict": True},
    }


def test_json_schema_answers_always_validate(server_per_executor: ServerProcess) -> None:
    client = server_per_executor.client()
    for seed in SEEDS:
        chat = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format=_format(PROFILE),
        )
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content or ""), PROFILE)
        text = client.completions.create(
            model=MODEL,
            prompt=f"Profile {seed}:",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            extra_body={"response_format": _format(PROFILE)},
        )
        jsonschema.validate(json.loads(text.choices[0].text), PROFILE)


def test_streamed_answers_validate_and_match_non_streamed_for_greedy(server: ServerProcess) -> None:
    client = server.client()
    for seed in SEEDS[:3]:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            stream=True,
            response_format=_format(PROFILE),
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        jsonschema.validate(json.loads(text), PROFILE)
    kwargs = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 200,
        "temperature": 0.0,
        "response_format": _format(PROFILE),
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kwargs, stream=True)
        if c.choices
    )
    assert streamed == whole


def test_json_object_regex_and_choice(server: ServerProcess) -> None:
    client = server.client()
    complete = 0
    for seed in SEEDS:
        out = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=300,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_object"},
        )
        content = out.choices[0].message.content or ""
        if out.choices[0].finish_reason == "length":  # a long string cut by max_tokens
            assert content.startswith("{"), content
        else:  # the grammar ended it: a whole JSON object
            assert isinstance(json.loads(content), dict), content
            complete += 1
        regex = client.completions.create(
            model=MODEL,
            prompt="Code:",
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{2,4}"},
        )
        assert re.fullmatch(r"[A-Z]{3}-[0-9]{2,4}", regex.choices[0].text)
        choice = client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=20,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
        )
        assert choice.choices[0].message.content in ("positive", "negative")
    assert complete >= len(SEEDS) // 2  # at temperature 1 most seeds close the object


def _check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tools_always_yield_valid_calls(server: ServerProcess) -> None:
    client = server.client()
    tools = [WEATHER, TIME]
    named = {"type": "function", "function": {"name": "get_time"}}
    # (a random model rarely closes an open-ended array of calls: one call per answer here)
    for seed in SEEDS:
        for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_time"})):
            out = client.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                tools=tools,
                tool_choice=choice,
                max_tokens=200,
                temperature=1.0,
                seed=seed,
                parallel_tool_calls=False,
            )
            assert out.choices[0].finish_reason == "tool_calls"
            assert out.choices[0].message.content is None
            calls = out.choices[0].message.tool_calls or []
            assert len(calls) == 1
            _check_calls(calls, names)


def test_parallel_calls_are_allowed_unless_disabled() -> None:
    from inferflow.server.http.protocol import ChatCompletionRequest

    body = {"model": MODEL, "messages": CHAT, "tools": [WEATHER, TIME], "tool_choice": "required"}
    parallel = ChatCompletionRequest.model_validate(body).tool_constraint()
    single = ChatCompletionRequest.model_validate({**body, "parallel_tool_calls": False})
    assert parallel is not None and "maxItems" not in json.loads(parallel.spec)
    assert json.loads(single.tool_constraint().spec)["maxItems"] == 1  # type: ignore[union-attr]


def test_streamed_tool_calls_are_assembled_by_the_client(server: ServerProcess) -> None:
    client = server.client()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
        temperature=1.0,
        seed=3,
        stream=True,
        parallel_tool_calls=False,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        assert not chunk.choices[0].delta.content
        for piece in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(piece.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = piece.id or entry["id"]
            if piece.function is not None:
                entry["name"] += piece.function.name or ""
                entry["arguments"] += piece.function.arguments or ""
    assert finish == "tool_calls" and calls
    for entry in calls.values():
        assert entry["id"] and entry["name"] == "get_weather"
        jsonschema.validate(json.loads(entry["arguments"]), SCHEMAS["get_weather"])


def test_a_conversation_with_a_tool_result_continues(server: ServerProcess) -> None:
    client = server.client()
    first = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=200,
        temperature=0.0,
        parallel_tool_calls=False,
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    messages = [
        *CHAT,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    follow = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=8
    )
    assert follow.choices[0].finish_reason == "length"
    assert not follow.choices[0].message.tool_calls


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"response_format": _format({"type": "nope"})}, "response_format", "Invalid type"),
        ({"guided_json": "{not json"}, "guided_json", "not a JSON schema"),
        ({"guided_grammar": "start: ("}, "guided_grammar", "Expected"),
        ({"guided_choice": []}, "guided_choice", "at least one"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", ""),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", ""),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "llguidance"),
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
            "not in tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"},
            "tool_choice",
            "cannot be combined",
        ),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(
    server: ServerProcess, extra: dict, param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=5, extra_body=extra
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert says in body["message"]


# OpenAI (and vLLM) request fields this server does not implement: each is a 400 naming it,
# never accepted and ignored
UNSUPPORTED_CHAT = {
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "web_search_options": {},
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "flex",
    "verbosity": "low",
    "prompt_cache_key": "k",
    "safety_identifier": "u",
    "use_beam_search": True,
    "chat_template": "{{ x }}",
}
UNSUPPORTED_COMPLETIONS = {
    "store": True,
    "guided_whitespace_pattern": " ",
}


@pytest.mark.parametrize(("field", "value"), sorted(UNSUPPORTED_CHAT.items()))
def test_unsupported_chat_fields_are_refused(
    server: ServerProcess, field: str, value: object
) -> None:
    response = server.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": CHAT, "max_tokens": 2, field: value},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


@pytest.mark.parametrize(("field", "value"), sorted(UNSUPPORTED_COMPLETIONS.items()))
def test_unsupported_completion_fields_are_refused(
    server: ServerProcess, field: str, value: object
) -> None:
    response = server.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


def test_neutral_values_of_unsupported_fields_are_accepted(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": CHAT,
        "max_tokens": 2,
        "logit_bias": {},
        "store": False,
        "service_tier": "auto",
        "modalities": ["text"],
        "response_format": {"type": "text"},
    }
    assert server.post("/v1/chat/completions", json=body).status_code == 200


def test_compile_and_mask_time_reach_traces_and_metrics(server: ServerProcess) -> None:
    from test_server_telemetry import metric_value, spans_of

    schema = {
        "type": "object",
        "properties": {"v": {"enum": ["a", "b"]}},
        "required": ["v"],
        "additionalProperties": False,
    }
    trace_id = secrets.token_hex(16)
    for i in range(2):  # the second request finds the compiled grammar in the cache
        response = server.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "x",
                "max_tokens": 20,
                "response_format": _format(schema),
            },
            headers={
                "traceparent": f"00-{trace_id if i else secrets.token_hex(16)}-"
                f"{secrets.token_hex(8)}-01"
            },
        )
        assert response.status_code == 200 and json.loads(response.json()["choices"][0]["text"])
    deadline = time.monotonic() + 30
    while not (
        guided := [s for s in spans_of(server.traces_path, trace_id) if s["name"] == "guided"]
    ):
        assert time.monotonic() < deadline, "no guided span"
        time.sleep(0.2)
    attrs = {a["key"]: a["value"] for a in guided[0]["attributes"]}
    assert attrs["inferflow.guided.cache_hit"] == {"boolValue": True}
    assert attrs["inferflow.guided.kind"] == {"stringValue": "json_schema"}
    text = server.get("/metrics").text
    assert metric_value(text, "inferflow:guided_mask_seconds_count") > 0
    assert metric_value(text, "inferflow:guided_grammar_cache_hits_total") >= 1
    assert metric_value(text, "inferflow:guided_compile_seconds_count") >= 1
