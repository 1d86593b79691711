"""Tool calls in ``tool_choice: "auto"`` and reasoning through the real server and ``openai``.

The models are the tiny checkpoint with other chat templates and a scripted head: every
layer's output projections are zeroed, so the last hidden state is the current token's
embedding, and ``lm_head`` maps each token of a script to the next one (greedy then writes the
script, whatever the prompt says). What the script does not say comes from the ``auto``
grammar: once the call's marker is written, the call is held to the tool's schema.

- ``qwen-tools`` (a Qwen-style template with ``<tool_call>``: hermes) writes ``<tool_call>``;
- ``r1-llama`` (a Llama-3-style template with ``<|python_tag|>`` that opens ``<think>`` in the
  prompt, as DeepSeek-R1-Distill-Llama's: llama3_json + think) writes ``Plan.</think>{``;
- ``tiny`` is the trained tiny checkpoint as it is: its answer with tools in auto mode (the
  json grammar) is its answer without them.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from server_harness import ServerProcess, start_server

from inferflow.models.tiny import CHECKPOINT_FILES, TRAINED
from inferflow.models.tokenizer import Tokenizer

pytestmark = [pytest.mark.server, pytest.mark.slow]

QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if tools %}<tools>{{ tools | tojson }}</tools> Call one as "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
R1_LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}{% if tools %}Respond with "
    "{\"name\": function name, \"parameters\": ...} or <|python_tag|>{% endif %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n<think>\n"
    "{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
        "strict": True,
    },
}
ARGS_SCHEMA = {**WEATHER["function"]["parameters"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]


def scripted_checkpoint(folder: Path, template: str, script: str) -> Path:
    """The tiny checkpoint with ``template``, whose greedy answer to any chat starts ``script``."""
    folder.mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        shutil.copyfile(TRAINED / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    tok = Tokenizer(folder)
    ids = [tok.encode_chat(CHAT)[-1], *tok.encode(script, add_special_tokens=False)]
    successor: dict[int, int] = {}
    for token, following in itertools.pairwise(ids):
        assert successor.setdefault(token, following) == following, "a token with two successors"
    weights = load_file(folder / "model.safetensors")
    for key in weights:
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            weights[key] = np.zeros_like(weights[key])  # the residual stream is the embedding
    embed = weights["model.embed_tokens.weight"].astype(np.float32)
    norm = weights["model.norm.weight"].astype(np.float32)
    head = np.zeros(weights["lm_head.weight"].shape, np.float32)
    for token, following in successor.items():
        hidden = embed[token] / np.sqrt(np.mean(embed[token] ** 2) + 1e-5) * norm
        head[following] += 20 * hidden / np.linalg.norm(hidden)
    weights["lm_head.weight"] = head.astype(weights["lm_head.weight"].dtype)
    save_file(weights, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("tool_models")
    models = {
        "qwen-tools": scripted_checkpoint(root / "qwen", QWEN_TEMPLATE, "<tool_call>"),
        "r1-llama": scripted_checkpoint(root / "r1", R1_LLAMA_TEMPLATE, "Plan.</think>{"),
        "tiny": TRAINED,
    }
    overrides = ["model.max_model_len=512", "executor.kv_cache_memory=16MiB",
                 "batching.max_num_seqs=4"]
    for name, path in models.items():
        key = name.replace("-", "_")
        overrides += [f"+models.{key}.model.path={path}", f"+models.{key}.model.name={name}"]
    srv = start_server(tmp_path_factory, "tool_parsers", overrides)
    yield srv
    srv.terminate()


def _check_call(name: str, arguments: str) -> None:
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), ARGS_SCHEMA)


def _streamed(server: ServerProcess, **kwargs) -> tuple[str, str, list[dict], str | None]:
    """(reasoning, content, calls as the client assembles them, finish reason) of a stream."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in server.client().chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:  # a call's first chunk: id, type, name, arguments ""
                assert piece.index == len(calls) and piece.type == "function"
                assert piece.function.name and piece.function.arguments == ""
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            else:
                assert piece.index == len(calls) - 1 and piece.function.name is None
                calls[-1]["arguments"] += piece.function.arguments
        finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


@pytest.mark.parametrize("model", ["qwen-tools", "r1-llama"])
def test_auto_tool_calls_parse_streamed_and_not(server: ServerProcess, model: str) -> None:
    request = dict(model=model, messages=CHAT, tools=[WEATHER], temperature=0, max_tokens=64,
                   parallel_tool_calls=False)
    out = server.client().chat.completions.create(**request)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    _check_call(call.function.name, call.function.arguments)
    reasoning = getattr(choice.message, "reasoning_content", None)
    assert reasoning == ("Plan." if model == "r1-llama" else None)
    streamed_reasoning, content, calls, finish = _streamed(server, **request)
    assert finish == "tool_calls" and content == ""  # no marker reaches the content
    assert streamed_reasoning == (reasoning or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)  # greedy: the same call
    ]


def test_a_think_template_streams_reasoning_apart(server: ServerProcess) -> None:
    reasoning, content, calls, finish = _streamed(
        server, model="r1-llama", messages=CHAT, temperature=0, max_tokens=12
    )
    assert reasoning == "Plan." and content.startswith("{") and "</think>" not in content
    assert calls == [] and finish == "length"


def test_a_plain_answer_is_untouched_by_the_auto_grammar(server: ServerProcess) -> None:
    client = server.client()
    plain = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                           max_tokens=24)
    with_tools = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                                max_tokens=24, tools=[WEATHER])
    text = plain.choices[0].message.content
    assert text and not text.lstrip().startswith(("{", "["))
    assert with_tools.choices[0].message.content == text
    assert with_tools.choices[0].finish_reason == plain.choices[0].finish_reason
    assert not with_tools.choices[0].message.tool_calls
