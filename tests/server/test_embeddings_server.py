"""/v1/embeddings through real servers (``python -m inferflow ...``) and the ``openai`` client.

Two servers for the whole module: an embedding-only MiniLM server (``+model=minilm
batching=dynamic``) and a multi-model server (tiny LLM + two MiniLM versions with a 0.8/0.2
canary split, ``+extra_models=minilm_canary``). sentence-transformers is the oracle.
"""

from __future__ import annotations

import base64
import os
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from hostile_json import check_answer, client_port, has_lone_surrogate, hostile_bodies
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, start_server

from inferflow.models.bert import minilm_path

pytestmark = [pytest.mark.server, pytest.mark.slow]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MINILM = "all-minilm-l6-v2"
SENTENCES = [
    "A man is playing a guitar.",
    "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun.",
    "Grüße aus Köln — ünïcödé works too 🙂",
    "Embeddings map text to vectors.",
]


@pytest.fixture(scope="module")
def embed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    traces = tmp_path_factory.mktemp("embed_traces") / "traces.jsonl"
    srv = start_server(
        tmp_path_factory,
        "embed",
        ["+model=minilm", "batching=dynamic", "tracing=file", f"tracing.file_path={traces}"],
    )
    srv.traces_path = traces  # type: ignore[attr-defined]
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def multi_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory, "multi", ["+extra_models=minilm_canary"])
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def oracle():  # type: ignore[no-untyped-def]
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_single_and_batched_equal_sentence_transformers(embed_server, oracle) -> None:
    client = embed_server.client()
    expected = oracle.encode(SENTENCES, convert_to_numpy=True)
    single = client.embeddings.create(model=MINILM, input=SENTENCES[0])
    assert len(single.data) == 1 and len(single.data[0].embedding) == 384
    assert _cos(np.array(single.data[0].embedding), expected[0]) >= 0.9999
    batch = client.embeddings.create(model=MINILM, input=SENTENCES, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(len(SENTENCES)))
    for row, want in zip(batch.data, expected, strict=True):
        assert _cos(np.array(row.embedding), want) >= 0.9999
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > len(SENTENCES) * 3
    tokenized = oracle.tokenizer(SENTENCES)["input_ids"]
    assert batch.usage.prompt_tokens == sum(len(ids) for ids in tokenized)


def test_token_ids_and_base64(embed_server, oracle) -> None:
    client = embed_server.client()
    ids = oracle.tokenizer(SENTENCES[:2])["input_ids"]
    expected = oracle.encode(SENTENCES[:2], convert_to_numpy=True)
    one = client.embeddings.create(model=MINILM, input=ids[0])
    assert _cos(np.array(one.data[0].embedding), expected[0]) >= 0.9999
    assert one.usage.prompt_tokens == len(ids[0])
    many = client.embeddings.create(model=MINILM, input=ids)
    for row, want in zip(many.data, expected, strict=True):
        assert _cos(np.array(row.embedding), want) >= 0.9999
    raw = embed_server.post(
        "/v1/embeddings",
        json={"model": MINILM, "input": SENTENCES[:2], "encoding_format": "base64"},
    ).json()
    floats = client.embeddings.create(model=MINILM, input=SENTENCES[:2])
    for row, ref in zip(raw["data"], floats.data, strict=True):
        vec = np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4")
        np.testing.assert_allclose(vec, np.array(ref.embedding, dtype=np.float32), atol=1e-6)
    # the openai client asks for base64 by default and decodes it itself
    decoded = client.embeddings.create(model=MINILM, input=SENTENCES[0], encoding_format="base64")
    assert isinstance(decoded.data[0].embedding, str)


def test_request_errors(embed_server) -> None:
    bad_dim = embed_server.post(
        "/v1/embeddings", json={"model": MINILM, "input": "x", "dimensions": 128}
    )
    assert bad_dim.status_code == 400 and bad_dim.json()["error"]["param"] == "dimensions"
    ok_dim = embed_server.post(
        "/v1/embeddings", json={"model": MINILM, "input": "x", "dimensions": 384}
    )
    assert ok_dim.status_code == 200
    empty = embed_server.post("/v1/embeddings", json={"model": MINILM, "input": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "input"
    fmt = embed_server.post(
        "/v1/embeddings", json={"model": MINILM, "input": "x", "encoding_format": "int8"}
    )
    assert fmt.status_code == 400 and fmt.json()["error"]["param"] == "encoding_format"
    vocab = embed_server.post("/v1/embeddings", json={"model": MINILM, "input": [10**9]})
    assert vocab.status_code == 400 and vocab.json()["error"]["param"].startswith("input")
    completions = embed_server.post("/v1/completions", json={"model": MINILM, "prompt": "hi"})
    assert completions.status_code == 400
    assert completions.json()["error"]["code"] == "model_not_supported"
    chat = embed_server.post(
        "/v1/chat/completions",
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"


@settings(max_examples=30, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=hostile_bodies({"model": MINILM, "input": ["hi"], "encoding_format": "float"}))
def test_hostile_keys_are_never_a_5xx_and_keep_the_connection(embed_server, body) -> None:
    """Odd keys at any depth (``hostile_json``): never a 5xx, a 400 for a lone surrogate, and
    the same keep-alive connection serves the next request."""
    with httpx.Client(base_url=embed_server.base_url, timeout=60) as http:
        response = http.post(
            "/v1/embeddings", content=body, headers={"content-type": "application/json"}
        )
        check_answer(response, body)
        assert response.status_code == 400 or not has_lone_surrogate(body), response.text
        following = http.post("/v1/embeddings", json={"model": MINILM, "input": "hi"})
        assert following.status_code == 200
        assert client_port(following) == client_port(response), "the connection was closed"


def test_32_concurrent_clients_form_batches(embed_server) -> None:
    client = embed_server.client()
    before = embed_server.stats()["embeddings"][f"{MINILM}@1"]["items_processed"]

    def one(i: int) -> int:
        text = f"request number {i}: " + SENTENCES[i % len(SENTENCES)]
        return len(client.embeddings.create(model=MINILM, input=text).data)

    with ThreadPoolExecutor(32) as pool:
        assert sum(pool.map(one, range(128))) == 128
    stats = embed_server.stats()["embeddings"][f"{MINILM}@1"]
    assert stats["items_processed"] - before == 128
    sizes = {int(size) for size in stats["batch_size_histogram"]}
    assert max(sizes) > 1, stats["batch_size_histogram"]
    metrics = embed_server.get("/metrics").text
    assert f'inferflow:embedding_requests_total{{model="{MINILM}",version="1"}}' in metrics
    # the batch-size histogram in /metrics: some batch had more than one input
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    buckets = {
        s.labels["le"]: s.value
        for s in families["inferflow:embedding_batch_size"].samples
        if s.name.endswith("_bucket") and s.labels.get("model") == MINILM
    }
    assert buckets["+Inf"] > buckets["1.0"], buckets


def test_models_lists_llm_and_embedding_versions(multi_server) -> None:
    ids = [m.id for m in multi_server.client().models.list().data]
    assert ids == ["tiny-llama", MINILM, f"{MINILM}@1", f"{MINILM}@2"]
    completion = multi_server.client().completions.create(
        model="tiny-llama", prompt="Hello", max_tokens=2
    )
    assert completion.usage.completion_tokens == 2
    wrong = multi_server.post("/v1/completions", json={"model": MINILM, "prompt": "hi"})
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "model_not_supported"


def test_unknown_model_is_404_in_openai_shape(multi_server) -> None:
    response = multi_server.post("/v1/embeddings", json={"model": "no-such-model", "input": "x"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `no-such-model` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    pinned_unknown = multi_server.post(
        "/v1/embeddings", json={"model": f"{MINILM}@9", "input": "x"}
    )
    assert pinned_unknown.status_code == 404


def test_canary_split_pinning_and_stickiness(multi_server) -> None:
    body = {"model": MINILM, "input": "canary"}
    with httpx.Client(base_url=multi_server.base_url, timeout=60) as http:
        served = []
        for _ in range(200):
            response = http.post("/v1/embeddings", json=body)
            assert response.status_code == 200
            version = response.headers["x-inferflow-model-version"]
            assert response.json()["model_version"] == version
            served.append(version)
        assert set(served) == {"1", "2"}
        # queue time apart from compute time, as the LLM routes report it
        assert float(response.headers["x-inferflow-queue-time-ms"]) >= 0
        assert float(response.headers["x-inferflow-inference-time-ms"]) > 0
        assert response.headers["server-timing"].startswith("queue;dur=")
        assert ", inference;dur=" in response.headers["server-timing"]
        # binomial sd = sqrt(0.16 / 200) = 0.028; +-0.1 is ~3.5 sd
        assert served.count("2") / 200 == pytest.approx(0.2, abs=0.1)
        pinned = {
            http.post("/v1/embeddings", json={**body, "model": f"{MINILM}@2"}).headers[
                "x-inferflow-model-version"
            ]
            for _ in range(10)
        }
        assert pinned == {"2"}
        sticky = {
            http.post("/v1/embeddings", json={**body, "user": "alice"}).headers[
                "x-inferflow-model-version"
            ]
            for _ in range(10)
        }
        assert len(sticky) == 1
        metrics = http.get("/metrics").text
    for version in ("1", "2"):
        assert (
            f'inferflow:embedding_requests_total{{model="{MINILM}",version="{version}"}}' in metrics
        )


def test_embedding_request_is_traced_with_queue_and_compute(embed_server) -> None:
    from test_server_telemetry import spans_of

    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = embed_server.post(
        "/v1/embeddings",
        json={"model": MINILM, "input": ["trace me", "and me"]},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    assert response.status_code == 200
    wanted = {f"embeddings {MINILM}", "queue", "compute"}
    deadline = time.monotonic() + 30  # the file exporter writes in batches
    while not wanted <= {s["name"] for s in spans_of(embed_server.traces_path, trace_id)}:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    by_name = {s["name"]: s for s in spans_of(embed_server.traces_path, trace_id)}
    root = by_name[f"embeddings {MINILM}"]
    assert root["parentSpanId"] == parent_id and root["kind"] == 2  # SERVER, client's span parent
    for child in ("queue", "compute"):
        assert by_name[child]["parentSpanId"] == root["spanId"]
    assert int(by_name["queue"]["endTimeUnixNano"]) <= int(by_name["compute"]["startTimeUnixNano"])
    assert int(by_name["compute"]["endTimeUnixNano"]) <= int(root["endTimeUnixNano"])


def test_embedding_rate_limits_answer_429_with_retry_after(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    srv = start_server(
        tmp_path_factory,
        "embed_limits",
        [
            "+model=minilm",
            "server.rate_limit_requests_per_minute=3",
            "server.rate_limit_tokens_per_minute=40",
        ],
    )
    try:
        body = {"model": MINILM, "input": "four tokens"}  # [CLS] four tokens [SEP]
        assert [srv.post("/v1/embeddings", json=body).status_code for _ in range(2)] == [200, 200]
        # the token budget (40/min) refuses a long input before any work is queued
        long = srv.post("/v1/embeddings", json={"model": MINILM, "input": "word " * 60})
        assert long.status_code == 429 and "tokens per minute" in long.json()["error"]["message"]
        assert float(long.headers["retry-after"]) > 0
        # the request budget (3/min) was spent by the three calls above
        over = srv.post("/v1/embeddings", json=body)
        assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
        assert "requests per minute" in over.json()["error"]["message"]
    finally:
        srv.terminate()
