"""The OpenAI surface against a real server, through the ``openai`` client, on both executors:
ONNX Runtime (the default: paged KV where its op builds, else slots) and torch (paged KV)."""

from __future__ import annotations

import httpx
import pytest
from server_harness import MODEL, ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.xdist_group("torch_server")]


@pytest.fixture
def server(server_per_executor: ServerProcess) -> ServerProcess:
    """Every test of this module runs on both executors."""
    return server_per_executor

PROMPT = "The quick brown fox"


def test_completion_non_streaming_reports_usage_and_length(server: ServerProcess) -> None:
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.model == MODEL
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_streamed_completion_equals_non_streamed_and_keeps_one_id(server: ServerProcess) -> None:
    client = server.client()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert len({c.id for c in chunks}) == 1
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_non_streaming_and_streaming_agree(server: ServerProcess) -> None:
    client = server.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0
    )
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason in ("length", "stop")
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert len({c.id for c in chunks}) == 1


def test_chat_without_max_tokens_fills_the_context(server: ServerProcess) -> None:
    """No max_tokens: the completion may use the rest of the context window, no more."""
    context = server.client().models.list().data[0].model_extra["max_model_len"]
    out = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a " * (context - 20)}],
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == context
    assert 0 < out.usage.completion_tokens < 20


def test_stop_string_ends_with_finish_reason_stop(server: ServerProcess) -> None:
    client = server.client()
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    text = base.choices[0].text
    stop = text[len(text) // 2 :][:3].strip() or text[-3:]
    assert stop, text
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].text
    assert text.startswith(out.choices[0].text)


def test_seed_makes_sampling_reproducible(server: ServerProcess) -> None:
    client = server.client()

    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed
        )
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_logprobs_for_both_endpoints(server: ServerProcess) -> None:
    client = server.client()
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(item.top_logprobs) == 3 for item in content)
    # greedy: the chosen token is the most likely one
    assert all(item.logprob >= max(t.logprob for t in item.top_logprobs) - 1e-6 for item in content)


def test_prompt_as_token_ids(server: ServerProcess) -> None:
    client = server.client()
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    response = server.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": [1, 200, 300, 400], "max_tokens": 5, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 4
    assert text.usage.prompt_tokens > 0


def test_models_health_ready_version(server: ServerProcess) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert server.get("/health").json()["status"] == "ok"
    ready = server.get("/ready").json()
    assert ready["status"] == "ready"
    assert [(m["id"], m["status"]) for m in ready["models"]] == [(f"{MODEL}@1", "ready")]
    version = server.get("/version").json()
    assert version["model"]["name"] == MODEL
    assert version["engine"]["backend"] and version["engine"]["runtime_version"]
    from inferflow.runtimes.ort_ops.build import op_status

    paged = version["engine"]["backend"] == "torch" or op_status()[0]
    assert version["engine"]["layout"]["paged"] is paged
    assert version["runtime"]["litserve"] == "0.2.19"
    assert version["inferflow"]
    assert version["model"]["architecture"] == "LlamaForCausalLM" and version["model"]["num_layers"]
    assert {"Qwen3ForCausalLM", "Gemma3ForCausalLM", "MixtralForCausalLM"} <= set(
        version["supported_architectures"])


def test_non_streaming_response_carries_timing_headers(server: ServerProcess) -> None:
    response = httpx.post(
        server.url("/v1/completions"),
        timeout=60,
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0},
    )
    assert response.status_code == 200
    assert float(response.headers["x-inferflow-queue-time-ms"]) >= 0
    assert float(response.headers["x-inferflow-inference-time-ms"]) >= 0
