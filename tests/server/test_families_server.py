"""A served Qwen3 and a served mixture of experts (Qwen3-MoE) answer the ``openai`` client over
127.0.0.1 exactly as the offline engine does: chat and completions, streamed and not, greedy.

One server, a model repository of both (checkpoints written by transformers' own
``save_pretrained``), with a small step budget so prompts are prefilled in chunks and the prefix
cache on: a repeated prompt reports cached tokens and the same answer. Structured output holds
with both. Speculative decoding (ngram) gives the plain engine's greedy output with both
(offline, where it is cheap).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_harness import ServerProcess, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

transformers = pytest.importorskip("transformers")

from engine.hf_checkpoints import save_hf_checkpoint  # noqa: E402

PROMPT = ("The Python tutorial explains how the interpreter reads a program, how names are bound "
          "in scopes, how exceptions travel up the stack and how modules are imported. ") * 3
MESSAGES = [{"role": "user", "content": "Name three things the tutorial explains."}]
CASES = {  # served name -> (architecture, config)
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 48}),
}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families_served")
    return {name: save_hf_checkpoint(root / name, arch, seed=21, **cfg)
            for name, (arch, cfg) in CASES.items()}


@pytest.fixture(scope="module")
def offline(checkpoints: dict[str, Path]) -> dict[str, dict[str, str]]:
    """What the offline engine answers: the completion and the chat reply, greedy."""
    from inferflow import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    out = {}
    for name, path in checkpoints.items():
        llm = LLM(path, max_model_len=512)
        out[name] = {"completion": llm.generate(PROMPT, params)[0].outputs[0].text,
                     "chat": llm.chat(MESSAGES, params)[0].outputs[0].text}
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]) -> Iterator[ServerProcess]:
    overrides = ["model.max_model_len=512", "executor.kv_cache_memory=32MiB",
                 "batching.max_num_seqs=4", "batching.max_num_batched_tokens=64"]  # chunked prefill
    for name, path in checkpoints.items():
        key = name.replace("-", "_")
        overrides += [f"+models.{key}.model.path={path}", f"+models.{key}.model.name={name}"]
    srv = start_server(tmp_path_factory, "families", overrides)
    yield srv
    srv.terminate()


@pytest.mark.parametrize("name", list(CASES))
def test_completions_and_chat_equal_the_offline_engine(
    server: ServerProcess, offline: dict[str, dict[str, str]], name: str
) -> None:
    client = server.client()
    want = offline[name]
    plain = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert plain.choices[0].text == want["completion"]
    streamed = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want["completion"]
    chat = client.chat.completions.create(model=name, messages=MESSAGES,  # type: ignore[arg-type]
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == want["chat"]
    chunks = client.chat.completions.create(model=name, messages=MESSAGES,  # type: ignore[arg-type]
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want["chat"]


@pytest.mark.parametrize("name", list(CASES))
def test_a_repeated_prompt_hits_the_prefix_cache(server: ServerProcess, name: str) -> None:
    client = server.client()
    prompt = f"{name}: " + PROMPT
    first = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
    again = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # whole blocks of the prompt


@pytest.mark.parametrize("name", list(CASES))
def test_structured_output(server: ServerProcess, name: str) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}  # a finite language: a random model must end it
    out = server.client().chat.completions.create(
        model=name, messages=MESSAGES, max_tokens=40, temperature=0,  # type: ignore[arg-type]
        response_format={"type": "json_schema",  # type: ignore[typeddict-item]
                         "json_schema": {"name": "ok", "schema": schema, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content or "")["ok"], bool)


@pytest.mark.parametrize("name", list(CASES))
def test_speculative_decoding_keeps_greedy_output(checkpoints: dict[str, Path], name: str) -> None:
    from inferflow import LLM, SamplingParams

    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(checkpoints[name], max_model_len=256).generate(prompt, params)[0].outputs[0]
    spec = LLM(checkpoints[name], max_model_len=256,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert spec.generate(prompt, params)[0].outputs[0].token_ids == plain.token_ids
