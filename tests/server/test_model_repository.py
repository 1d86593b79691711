"""The model repository on live servers, driven by the ``openai`` client over 127.0.0.1.

Two seeded Llama checkpoints (A: seed 1, B: seed 2, so their greedy outputs differ) and MiniLM:

- ``repo_server``: ``alpha`` in two versions at 50/50, v1 = A and v2 = a checkpoint whose
  weights are truncated (eager: it fails at start); ``beta`` in two versions, v1 = B (weight
  0.9, eager) and v2 = A (weight 0.1, on demand); MiniLM on /v1/embeddings; API keys on.
- ``on_demand_server``: ``a`` = A and ``b`` = B, both on demand, under a memory budget that fits
  one worker (1.5 x what ``repo_server`` counts for one of its workers, same engine settings),
  plus ``broken`` whose weights are truncated; traced to a file.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess, start_server, trace_spans

from inferflow.models.tiny import make_checkpoint
from inferflow.server.process_utils import descendants, process_rss

pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "k-repo"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox"
MAX_TOKENS = 8
# every engine's KV buffers: 64 MiB for 16 sequences (2048-token contexts), so that a worker's
# footprint is mostly its measured memory
KV_MEMORY = "executor.kv_cache_memory=64MiB"
SLOTS = "batching.max_num_seqs=16"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repo_checkpoints")
    paths = {"A": root / "ckpt-a", "B": root / "ckpt-b"}
    make_checkpoint(paths["A"], seed=1)
    make_checkpoint(paths["B"], seed=2)
    broken = root / "ckpt-broken"  # config and tokenizer fine, weights cut short
    shutil.copytree(paths["A"], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    paths["broken"] = broken
    return paths


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path]) -> dict[str, str]:
    """Greedy text of each checkpoint from the offline engine."""
    from inferflow import LLM, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = {}
    for name in ("A", "B"):
        llm = LLM(checkpoints[name])
        out[name] = llm.generate(PROMPT, params)[0].outputs[0].text
        del llm
    assert out["A"] != out["B"], "the two seeds must give different greedy outputs"
    return out


def _entry(key: str, path: Path, name: str, version: str = "1", weight: float = 1.0,
           load: str = "eager") -> list[str]:
    return [
        f"+models.{key}.model.path={path}",
        f"+models.{key}.model.name={name}",
        f"+models.{key}.model.version={version}",
        f"+models.{key}.model.weight={weight}",
        f"+models.{key}.load={load}",
    ]


@pytest.fixture(scope="module")
def repo_server(
    tmp_path_factory: pytest.TempPathFactory, checkpoints: dict[str, Path]
) -> Iterator[ServerProcess]:
    overrides = [
        *_entry("alpha", checkpoints["A"], "alpha"),
        *_entry("alpha_v2", checkpoints["broken"], "alpha", "2", 1.0),
        *_entry("beta_v1", checkpoints["B"], "beta", "1", 0.9),
        *_entry("beta_v2", checkpoints["A"], "beta", "2", 0.1, load="on_demand"),
        "+models.minilm.model.builtin=minilm",
        "+models.minilm.model.task=embed",
        f"server.api_keys=[{KEY}]",
        f"server.admin_keys=[{KEY}]",
        KV_MEMORY,
        SLOTS,
    ]
    server = start_server(tmp_path_factory, "repo", overrides)
    server.admin_key = KEY  # type: ignore[attr-defined]  # for wait_until's /admin/stats
    yield server
    server.terminate()


def complete(server: ServerProcess, model: str, **kwargs: object) -> tuple[str, str]:
    """(text, version that answered) of one greedy completion."""
    raw = server.client(api_key=KEY).completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=kwargs.pop("max_tokens", MAX_TOKENS),
        temperature=0.0, extra_body={"ignore_eos": True}, **kwargs,
    )
    return raw.parse().choices[0].text, raw.headers["x-inferflow-model-version"]


def test_each_model_answers_with_its_own_greedy_tokens(
    repo_server: ServerProcess, expected: dict[str, str]
) -> None:
    first_load: dict = {}
    waiting = threading.Thread(  # beta@2 is on demand: this request waits for its load
        target=lambda: first_load.update(answer=complete(repo_server, "beta@2"))
    )
    waiting.start()
    repo_server.wait_until(
        lambda s: s["models"]["beta@2"]["status"] == "loading", timeout=30, what="beta@2 loading"
    )
    # a loaded model answers meanwhile: a load never blocks the others (~30 ms vs ~1.5 s)
    assert complete(repo_server, "alpha") == (expected["A"], "1")
    assert waiting.is_alive()
    assert complete(repo_server, "beta@1") == (expected["B"], "1")
    waiting.join(120)
    assert first_load["answer"] == (expected["A"], "2")
    embedding = repo_server.client(api_key=KEY).embeddings.create(
        model="all-minilm-l6-v2", input="hello"
    )
    assert len(embedding.data[0].embedding) == 384
    ids = [m.id for m in repo_server.client(api_key=KEY).models.list().data]
    assert {"alpha", "beta", "beta@1", "beta@2", "all-minilm-l6-v2"} <= set(ids)


def test_unknown_model_is_a_404_naming_the_served_ones(repo_server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        repo_server.client(api_key=KEY).completions.create(model="gamma", prompt="x")
    error = err.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "alpha" in error["message"] and "beta@2" in error["message"]


def test_ready_and_version_list_every_model(repo_server: ServerProcess) -> None:
    ready = repo_server.get("/ready").json()
    assert ready["status"] == "ready"
    by_id = {m["id"]: m for m in ready["models"]}
    assert set(by_id) == {"alpha@1", "alpha@2", "beta@1", "beta@2"}
    assert by_id["beta@2"]["load"] == "on_demand"
    assert by_id["alpha@2"]["status"] == "failed"  # ... and does not hold the server back
    version = repo_server.get("/version", headers=AUTH).json()
    assert [m["id"] for m in version["models"]] == ["alpha@1", "alpha@2", "beta@1", "beta@2"]
    assert version["runtime"]["onnxruntime"]


def _repository_gauges(server: ServerProcess, name: str) -> dict[tuple[str, str], float]:
    """(gauge, version) -> value of model ``name`` in ``/metrics``."""
    text = server.get("/metrics", headers=AUTH).text
    return {
        (f.name, s.labels["version"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if f.name.startswith("inferflow:model_") and s.labels.get("model_name") == name
    }


def test_unpinned_requests_skip_a_version_that_failed_to_load(repo_server: ServerProcess) -> None:
    # alpha@2 failed at start; at 50/50 it would have taken about half of these
    assert [complete(repo_server, "alpha", max_tokens=1)[1] for _ in range(20)] == ["1"] * 20
    pinned = repo_server.post(
        "/v1/completions", json={"model": "alpha@2", "prompt": "x", "max_tokens": 1},
        headers=AUTH,
    )
    assert pinned.status_code == 503 and pinned.json()["error"]["code"] == "model_load_failed"
    assert int(pinned.headers["retry-after"]) >= 1
    cards = repo_server.get("/v1/models", headers=AUTH).json()["data"]
    versions = {v["version"]: v for v in next(c for c in cards if c["id"] == "alpha")["versions"]}
    assert versions["1"]["routable"] and versions["1"]["effective_weight"] == 1.0
    assert versions["2"]["weight"] == 1.0 and versions["2"]["effective_weight"] == 0.0
    assert not versions["2"]["routable"] and versions["2"]["status"] == "failed"
    gauges = _repository_gauges(repo_server, "alpha")  # the configured split stands
    assert [gauges[(f"inferflow:model_{g}", v)] for g, v in (
        ("effective_weight", "1"), ("effective_weight", "2"), ("routable", "2"), ("weight", "2")
    )] == [1.0, 0.0, 0.0, 1.0]


def test_traffic_refuses_minus_zero_and_bounds_an_unknown_version_error(
    repo_server: ServerProcess,
) -> None:
    def traffic(weights: dict[str, float]) -> httpx.Response:
        return repo_server.post("/admin/models/beta/traffic", json={"weights": weights},
                                headers=AUTH)

    minus_zero = traffic({"1": 1.0, "2": -0.0})
    assert minus_zero.status_code == 400 and minus_zero.json()["error"]["param"] == "weights"
    names = {f"v{i}-" + "x" * 100: 1.0 for i in range(5000)}  # a ~550 KB body
    unknown = traffic(names)
    assert unknown.status_code == 400 and len(unknown.content) < 2048, len(unknown.content)
    assert "and 4997 more" in unknown.json()["error"]["message"]
    cards = repo_server.get("/v1/models", headers=AUTH).json()["data"]
    beta = next(c for c in cards if c["id"] == "beta")
    assert {v["version"]: v["weight"] for v in beta["versions"]} == {"1": 0.9, "2": 0.1}


def test_canary_split_of_200_unpinned_requests(repo_server: ServerProcess) -> None:
    versions = [complete(repo_server, "beta", max_tokens=1)[1] for _ in range(200)]
    hits = versions.count("2")
    # binomial(200, 0.1): mean 20, sd 4.24; 4 sd either side
    assert abs(hits - 20) <= 4 * math.sqrt(200 * 0.1 * 0.9), versions


def test_sticky_key_keeps_a_user_on_one_version(repo_server: ServerProcess) -> None:
    for user in ("alice", "bob", "carol", "dave"):
        seen = {complete(repo_server, "beta", max_tokens=1, user=user)[1] for _ in range(8)}
        assert len(seen) == 1, (user, seen)
    headers = {"x-inferflow-route-key": "session-42"}
    seen = {
        repo_server.client(api_key=KEY, default_headers=headers)
        .completions.with_raw_response.create(model="beta", prompt="x", max_tokens=1)
        .headers["x-inferflow-model-version"]
        for _ in range(8)
    }
    assert len(seen) == 1


def _stream(server: ServerProcess, model: str, max_tokens: int, out: dict) -> None:
    try:
        stream = server.client(api_key=KEY).completions.create(
            model=model, prompt=PROMPT, max_tokens=max_tokens, stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        out["finish"] = chunks[-1].choices[0].finish_reason
        out["chunks"] = len(chunks)
    except openai.APIError as exc:
        out["error"] = exc


def test_promote_takes_effect_without_restart_or_failing_in_flight(
    repo_server: ServerProcess,
) -> None:
    with pytest.raises(httpx.HTTPStatusError):  # the admin endpoint needs the key
        repo_server.post("/admin/models/beta/promote", json={"version": "2"}).raise_for_status()
    pid = repo_server.pid
    in_flight: dict = {}
    stream = threading.Thread(target=_stream, args=(repo_server, "beta@1", 400, in_flight))
    stream.start()
    try:
        repo_server.wait_until(lambda s: s["models"]["beta@1"]["in_flight"] >= 1, timeout=30,
                               what="a stream on beta@1")
        promoted = repo_server.post(
            "/admin/models/beta/promote", json={"version": "2"}, headers=AUTH
        )
        assert promoted.status_code == 200, promoted.text
        assert {v["version"]: v["weight"] for v in promoted.json()["versions"]} == {
            "1": 0.0, "2": 1.0,
        }
        assert {complete(repo_server, "beta", max_tokens=1)[1] for _ in range(20)} == {"2"}
        bad = repo_server.post(
            "/admin/models/beta/traffic", json={"weights": {"7": 1}}, headers=AUTH
        )
        assert bad.status_code == 400 and "7" in bad.json()["error"]["message"]
    finally:
        stream.join(60)
        restored = repo_server.post(
            "/admin/models/beta/traffic", json={"weights": {"1": 0.9, "2": 0.1}}, headers=AUTH
        )
        assert restored.status_code == 200
    assert in_flight.get("finish") == "length", in_flight  # the in-flight stream was not cut
    assert repo_server.pid == pid and repo_server.proc.poll() is None


def _worker_pid(server: ServerProcess, model_id: str) -> int:
    return int(server.stats(api_key=KEY)["models"][model_id]["worker_pid"])


def test_killing_one_models_worker_fails_only_its_requests_and_it_reloads(
    repo_server: ServerProcess, expected: dict[str, str]
) -> None:
    complete(repo_server, "beta@2")  # loaded
    victim = _worker_pid(repo_server, "beta@2")
    doomed: dict = {}
    survivor: dict = {}
    threads = [
        threading.Thread(target=_stream, args=(repo_server, "beta@2", 1500, doomed)),
        threading.Thread(target=_stream, args=(repo_server, "alpha", 300, survivor)),
    ]
    for t in threads:
        t.start()
    repo_server.wait_until(
        lambda s: s["models"]["beta@2"]["in_flight"] >= 1 and s["models"]["alpha@1"]["in_flight"],
        timeout=30, what="streams on beta@2 and alpha",
    )
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(90)
    assert isinstance(doomed.get("error"), openai.APIError), doomed  # explicit, not truncated
    assert "crashed" in str(doomed["error"])
    assert survivor.get("finish") == "length", survivor
    assert complete(repo_server, "beta@2") == (expected["A"], "2")  # reloaded on demand
    assert _worker_pid(repo_server, "beta@2") != victim


@pytest.fixture(scope="module")
def on_demand_server(
    tmp_path_factory: pytest.TempPathFactory,
    checkpoints: dict[str, Path],
    repo_server: ServerProcess,
) -> Iterator[ServerProcess]:
    # what the budget counts for one worker of these checkpoints (same engine settings): its
    # estimate or its measured RSS, whichever is larger; one fits, two do not
    models = repo_server.get("/ready").json()["models"]
    footprint = max(max(m["memory_bytes"], m["rss_bytes"] or 0) for m in models)
    budget = int(1.5 * footprint)
    traces = tmp_path_factory.mktemp("repo_traces") / "traces.jsonl"
    overrides = [
        *_entry("a", checkpoints["A"], "a", load="on_demand"),
        *_entry("b", checkpoints["B"], "b", load="on_demand"),
        *_entry("broken", checkpoints["broken"], "broken", load="on_demand"),
        f"server.model_memory_budget={budget}",
        KV_MEMORY,
        SLOTS,
        "tracing=file",
        f"tracing.file_path={traces}",
    ]
    server = start_server(tmp_path_factory, "on_demand", overrides)
    server.budget = budget  # type: ignore[attr-defined]
    server.traces_path = traces  # type: ignore[attr-defined]
    yield server
    server.terminate()


def _workers_rss(server: ServerProcess) -> int:
    pids = [p for p in descendants(server.pid)
            if Path(f"/proc/{p}/comm").exists()
            and Path(f"/proc/{p}/comm").read_text().startswith("inferflow-llm")]
    return sum(process_rss(p) for p in pids)


def test_on_demand_models_take_turns_within_the_memory_budget(
    on_demand_server: ServerProcess, expected: dict[str, str]
) -> None:
    server = on_demand_server
    budget = server.budget  # type: ignore[attr-defined]
    margin = budget // 10  # stated margin: 10 % (RSS grows a little while a model serves)
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0,
                           timeout=120)
    for model, ckpt in [("a", "A"), ("b", "B"), ("a", "A"), ("b", "B")]:
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == expected[ckpt]
        assert _workers_rss(server) <= budget + margin
        status = {m["id"]: m["status"] for m in server.get("/ready").json()["models"]}
        other = "b@1" if model == "a" else "a@1"
        assert status[f"{model}@1"] == "ready" and status[other] in ("unloaded", "unloading")
        # once its worker has exited, the unloaded model shows no worker and no counters
        gone = server.wait_until(lambda s, o=other: s["models"][o]["status"] == "unloaded",
                                 timeout=30, what=f"{other} unloaded")["models"][other]
        assert gone["worker_pid"] == gone["finished_requests"] == gone["total_slots"] == 0, gone
    deadline = time.monotonic() + 30  # spans are exported in batches, every few seconds
    while len(spans := _spans(server.traces_path, "model_load")) < 4:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, spans  # every request above waited for its model
        time.sleep(0.2)
    outcomes = {
        a["value"]["stringValue"]
        for s in spans
        for a in s["attributes"]
        if a["key"] == "inferflow.model_load.outcome"
    }
    assert outcomes == {"loaded"}
    families = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    loads = {s.labels["model_name"]: s.value for s in families["inferflow:model_loads"].samples}
    unloads = {s.labels["model_name"]: s.value
               for s in families["inferflow:model_unloads"].samples}
    assert loads["a"] == loads["b"] == 2 and unloads["a"] == 2 and unloads["b"] >= 1
    waits = families["inferflow:model_load_wait_seconds"].samples
    assert any(s.name.endswith("_count") and s.labels["outcome"] == "loaded" and s.value >= 2
               for s in waits)


def _spans(path: Path, name: str) -> list[dict]:
    return [s for s in trace_spans(path) if s["name"] == name]


def test_a_model_that_fails_to_load_is_reported_and_the_rest_serve(
    on_demand_server: ServerProcess,
) -> None:
    response = on_demand_server.post(
        "/v1/completions", json={"model": "broken", "prompt": "x", "max_tokens": 2}
    )
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "model_load_failed"
    ready = on_demand_server.get("/ready")
    assert ready.status_code == 200
    broken = next(m for m in ready.json()["models"] if m["id"] == "broken@1")
    assert broken["status"] == "failed" and broken["error"]
    ok = on_demand_server.post(
        "/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2}
    )
    assert ok.status_code == 200
