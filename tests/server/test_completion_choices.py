"""Several prompts per request, ``n``, ``best_of`` and ``echo`` against a real server (the
default graph): each choice equals what a request of its own prompt and seed answers."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest
from server_harness import MODEL, ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPTS = ["The quick brown fox", "Once upon a time", "A B C"]


def complete(server: ServerProcess, **body: object) -> dict:
    response = server.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def stream(server: ServerProcess, **body: object) -> list[dict]:
    with httpx.stream(
        "POST", server.url("/v1/completions"), json={"model": MODEL, "stream": True, **body},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_several_prompts_answer_in_order_as_single_requests(server: ServerProcess) -> None:
    batch = complete(server, prompt=PROMPTS, max_tokens=6, temperature=0)
    singles = [complete(server, prompt=p, max_tokens=6, temperature=0) for p in PROMPTS]
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    assert [c["text"] for c in batch["choices"]] == [s["choices"][0]["text"] for s in singles]
    for key in ("prompt_tokens", "completion_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in singles)
    ids = [[1, 2, 3, 4], [5, 6, 7]]  # token-id prompts too
    by_ids = complete(server, prompt=ids, max_tokens=4, temperature=0)
    assert [c["text"] for c in by_ids["choices"]] == [
        complete(server, prompt=p, max_tokens=4, temperature=0)["choices"][0]["text"] for p in ids
    ]


def test_n_choices_sample_with_seed_plus_index(server: ServerProcess) -> None:
    body = {"max_tokens": 8, "temperature": 1.0, "seed": 7}
    out = complete(server, prompt=PROMPTS[:2], n=3, **body)
    assert [c["index"] for c in out["choices"]] == list(range(6))
    for p, prompt in enumerate(PROMPTS[:2]):
        for i in range(3):
            alone = complete(server, prompt=prompt, **{**body, "seed": 7 + i})
            assert out["choices"][p * 3 + i]["text"] == alone["choices"][0]["text"]
    # prompt tokens counted once per prompt, completion tokens for every choice
    prompt_tokens = [
        complete(server, prompt=p, max_tokens=1)["usage"]["prompt_tokens"] for p in PROMPTS[:2]
    ]
    assert out["usage"]["completion_tokens"] == 6 * 8
    assert out["usage"]["prompt_tokens"] == sum(prompt_tokens)


def test_streamed_choices_carry_their_index_and_usage_comes_last(server: ServerProcess) -> None:
    body = {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    full = complete(server, **body)
    chunks = stream(server, **body, stream_options={"include_usage": True})
    texts: dict[int, str] = defaultdict(str)
    finishes = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert dict(texts) == {c["index"]: c["text"] for c in full["choices"]}
    assert finishes == {i: "length" for i in range(4)}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_best_of_returns_the_most_likely_sequences(server: ServerProcess) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "seed": 11}
    out = complete(server, **body, n=2, best_of=4)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in out["choices"])  # not asked for
    scored = []
    for i in range(4):
        alone = complete(server, **{**body, "seed": 11 + i}, logprobs=0)["choices"][0]
        scored.append((sum(alone["logprobs"]["token_logprobs"]), i, alone["text"]))
    best = sorted(scored, reverse=True)[:2]
    assert [c["text"] for c in out["choices"]] == [t for _, _, t in sorted(best, key=lambda s: s[1])]
    assert out["usage"]["completion_tokens"] == 4 * 6  # every generated sequence is counted


def test_echo_prepends_the_prompt(server: ServerProcess) -> None:
    plain = complete(server, prompt=PROMPTS, max_tokens=5, temperature=0)
    echoed = complete(server, prompt=PROMPTS, max_tokens=5, temperature=0, echo=True)
    for prompt, a, b in zip(PROMPTS, plain["choices"], echoed["choices"], strict=True):
        assert b["text"] == prompt + a["text"]
    chunks = stream(server, prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPTS[0])
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["choices"][0]["text"]


def test_a_failing_prompt_fails_the_request(server: ServerProcess) -> None:
    response = server.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": ["fine", "word " * 3000], "max_tokens": 4},
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_chat_n_choices_with_top_logprobs_streamed_and_not(server: ServerProcess) -> None:
    client = server.client()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 5,
        "logprobs": True,
        "top_logprobs": 2,
    }
    out = client.chat.completions.create(**body, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for i, choice in enumerate(out.choices):
        alone = client.chat.completions.create(**{**body, "seed": 5 + i}).choices[0]
        assert choice.message.content == alone.message.content
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(
            [e.logprob for e in alone.logprobs.content], abs=1e-4
        )
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    texts: dict[int, str] = defaultdict(str)
    roles = []
    for chunk in client.chat.completions.create(**body, n=3, stream=True):
        (choice,) = chunk.choices
        roles += [choice.index] if choice.delta.role else []
        texts[choice.index] += choice.delta.content or ""
    assert sorted(roles) == [0, 1, 2]
    assert dict(texts) == {c.index: c.message.content for c in out.choices}


def test_echo_logprobs_cover_the_prompt_and_prompt_logprobs_agree(server: ServerProcess) -> None:
    body = {"prompt": PROMPTS[0], "temperature": 0, "logprobs": 2}
    plain = complete(server, **body, max_tokens=3)["choices"][0]["logprobs"]
    echoed = complete(server, **body, max_tokens=3, echo=True, n=2)
    n_prompt = echoed["usage"]["prompt_tokens"]
    first, second = (c["logprobs"] for c in echoed["choices"])
    # the sibling renders its leader's prompt logprobs (the same rows, exactly)
    assert first["tokens"] == second["tokens"]
    assert first["token_logprobs"][:n_prompt] == second["token_logprobs"][:n_prompt]
    assert first["token_logprobs"][n_prompt:] == pytest.approx(
        second["token_logprobs"][n_prompt:], abs=1e-4)
    assert len(first["tokens"]) == n_prompt + 3
    assert first["token_logprobs"][0] is None and first["top_logprobs"][0] is None
    assert first["tokens"][n_prompt:] == plain["tokens"]
    assert first["token_logprobs"][n_prompt:] == pytest.approx(plain["token_logprobs"], abs=1e-4)
    for token, lp, top in zip(first["tokens"][1:n_prompt], first["token_logprobs"][1:n_prompt],
                              first["top_logprobs"][1:n_prompt], strict=True):
        assert top[token] == lp and max(top.values()) >= lp and len(top) in (2, 3)
    assert first["text_offset"][n_prompt] == len("".join(first["tokens"][:n_prompt]))
    # max_tokens 0: the prompt alone, the same logprobs
    alone = complete(server, **body, max_tokens=0, echo=True)
    choice = alone["choices"][0]
    assert choice["text"] == PROMPTS[0] and choice["finish_reason"] == "length"
    assert alone["usage"]["completion_tokens"] == 0
    assert choice["logprobs"]["tokens"] == first["tokens"][:n_prompt]
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        first["token_logprobs"][1:n_prompt], abs=1e-4)
    # vLLM's prompt_logprobs: the same numbers, keyed by token id
    vllm = complete(server, prompt=PROMPTS[0], max_tokens=1, prompt_logprobs=1)["choices"][0]
    steps = vllm["prompt_logprobs"]
    assert steps[0] is None and len(steps) == n_prompt
    for step, token, lp in zip(steps[1:], first["tokens"][1:n_prompt],
                               first["token_logprobs"][1:n_prompt], strict=True):
        entry = next(e for e in step.values() if e["decoded_token"] == token)
        assert entry["logprob"] == pytest.approx(lp, abs=1e-4)
        assert any(e["rank"] == 1 for e in step.values())
    # streamed: the prompt and its logprobs in the first chunk
    chunks = stream(server, **body, max_tokens=3, echo=True)
    head = chunks[0]["choices"][0]
    assert head["text"].startswith(PROMPTS[0])
    assert head["logprobs"]["tokens"][:n_prompt] == first["tokens"][:n_prompt]
