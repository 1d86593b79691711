"""Multi-LoRA over HTTP, as a client sees it (issue 43).

One server started as a user starts it (``python -m inferflow lora.adapters.sql=PATH ...``: the
default tiny Llama, two random PEFT adapters made with peft, runtime updates on, API and admin
keys, two API processes so that every answer comes from shared state), talked to with the real
``openai`` client on 127.0.0.1. The oracle is the offline ``LLM`` with the same adapters: each
adapter's greedy output must equal it token for token (its text), base model included. Then the
``/v1/models`` cards, a runtime load during traffic (requests for the other adapters unaffected),
an unload (then a 404 in OpenAI's shape), the refusals (a bad adapter, a name taken by the model,
an API key on the admin routes), the metrics and the request's span.

Fast unit checks of the pieces (settings, names, metrics text, shared state) come first.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL, ServerProcess, start_server, trace_spans

from inferflow.config import ConfigError
from inferflow.server.lora import LoraServing, lora_state, published_adapters
from inferflow.server.shared_state import SharedState

USER_KEY = "k-lora-user"
ADMIN_KEY = "k-lora-admin"
PROMPTS = ["The little robot", "Once upon a time, a"]
MAX_TOKENS = 12
TARGETS_QV = ("q_proj", "v_proj")


# --- units --------------------------------------------------------------------------------------
def test_lora_settings_from_config() -> None:
    assert LoraServing.from_config({}) is None  # ~lora
    assert LoraServing.from_config({"lora": {"adapters": {}, "max_loras": 4}}) is None  # off
    on = LoraServing.from_config({"lora": {"adapters": {"a": "/x"}, "max_loras": 2}})
    assert on == LoraServing({"a": "/x"}, 2, False)
    runtime = LoraServing.from_config({"lora": {"adapters": None, "allow_runtime_updates": True}})
    assert runtime is not None and runtime.allow_runtime_updates and runtime.adapters == {}


def test_published_adapters_fall_back_to_the_configured_ones_until_the_worker_publishes() -> None:
    shared = SharedState()
    lora = LoraServing({"a": "/ad/a"}, 2, True)
    assert published_adapters(shared, None) == {}
    assert published_adapters(shared, lora) == {"a": "/ad/a"}
    shared.publish_lora(lora_state({"b": "/ad/b"}, ["b"], [], 2, 1, 0))
    assert published_adapters(shared, lora) == {"b": "/ad/b"}  # the worker's list wins
    assert shared.lora()["running"] == ["b"]
    shared.clear_stats()  # the worker exited: its adapters stay (its successor restores them)
    assert published_adapters(shared, lora) == {"b": "/ad/b"}
    assert shared.lora() == {"adapters": [{"name": "b", "path": "/ad/b"}]}  # counters gone


def test_adapter_names_must_not_name_a_model_or_another_models_adapter() -> None:
    from inferflow.server.process.runtime import _check_adapter_names

    def deployment(name: str, key: str, adapters: dict[str, str]):  # what the check reads
        from types import SimpleNamespace

        return SimpleNamespace(name=name, model_id=f"{name}@1", key=key,
                               lora=LoraServing(adapters))

    _check_adapter_names([deployment("m", "", {"sql": "/p"})])
    with pytest.raises(ConfigError, match=r"lora\.adapters\.m: `m` is the name of a served"):
        _check_adapter_names([deployment("m", "", {"m": "/p"})])
    with pytest.raises(ConfigError, match=r"models\.b\.lora\.adapters\.sql: .*already an adapter"):
        _check_adapter_names([deployment("a", "a", {"sql": "/p"}),
                              deployment("b", "b", {"sql": "/q"})])
    with pytest.raises(ConfigError, match="name of a served model"):
        _check_adapter_names([deployment("a", "a", {}), deployment("b", "b", {"a@1": "/q"})])


def test_lora_metrics_text_is_vllms_gauge_and_the_counters() -> None:
    from types import SimpleNamespace

    from inferflow.server.http.lora import lora_metrics

    shared = SharedState()
    shared.publish_lora(lora_state({"a": "/a", "b": "/b"}, ["b", "a"], ["c"], 3, 4, 1, 2))
    served = SimpleNamespace(name="m", key="", model_id="m@1", shared=shared,
                             lora=LoraServing({}, 3, True))
    plain = SimpleNamespace(name="n", key="", model_id="n@1", shared=SharedState(), lora=None)
    assert lora_metrics([plain]) == b""  # type: ignore[list-item]
    families = {f.name: f for f in text_string_to_metric_families(
        lora_metrics([served, plain]).decode())}  # type: ignore[list-item]
    (info,) = families["vllm:lora_requests_info"].samples
    assert info.labels == {"model_name": "m", "max_lora": "3", "running_lora_adapters": "a,b",
                           "waiting_lora_adapters": "c"}
    assert abs(info.value - time.time()) < 60  # a timestamp, as vLLM's
    assert families["inferflow:lora_loads"].samples[0].value == 4
    assert families["inferflow:lora_unloads"].samples[0].value == 1
    assert families["inferflow:lora_slot_loads"].samples[0].value == 2


def test_the_router_finds_an_adapters_base_among_versions_and_lists_it() -> None:
    """A repository: ``model=ADAPTER`` reaches the version serving it (its worker's published
    list, else its configured one); the card's parent is ``name@version`` when the name has
    several versions."""
    from types import SimpleNamespace

    from inferflow.config import LoadMode
    from inferflow.server.http.deployments import Deployment, DeploymentRouter

    def version(key: str, name: str, v: str, lora: LoraServing | None) -> Deployment:
        return Deployment(key, name, v, LoadMode.eager, SimpleNamespace(max_model_len=64),  # type: ignore[arg-type]
                          SharedState(), None, lora=lora)  # type: ignore[arg-type]

    chat1 = version("chat", "chat", "1", LoraServing({"sql": "/a/sql"}))
    chat2 = version("chat2", "chat", "2", LoraServing({}, 2, True))
    small = version("small", "small", "1", None)
    router = DeploymentRouter([chat1, chat2, small])
    assert router.route_adapter("sql") is chat1 and router.route_adapter("fr") is None
    chat2.shared.publish_lora(lora_state({"fr": "/a/fr"}, [], [], 2, 1, 0))  # a runtime load
    assert router.route_adapter("fr") is chat2
    assert router.route("sql") is None  # models first: an adapter is never a model
    cards = {c["id"]: c for c in router.adapter_cards(0)}
    assert cards["sql"]["parent"] == "chat@1" and cards["fr"]["parent"] == "chat@2"
    assert cards["fr"]["root"] == "/a/fr" and set(cards) == {"sql", "fr"}


# --- a served model with adapters ---------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three random adapters of the default tiny Llama: two served from the start, one loaded at
    run time (``late``)."""
    pytest.importorskip("peft")
    from inferflow.models.tiny import tiny_llama_path
    from inferflow.testing.lora import make_peft_adapter

    base, out = tiny_llama_path(), tmp_path_factory.mktemp("adapters")
    return {
        "sql": make_peft_adapter(base, out / "sql", rank=8, alpha=16, seed=1),
        "chat": make_peft_adapter(base, out / "chat", rank=4, alpha=8, targets=TARGETS_QV, seed=2),
        "late": make_peft_adapter(base, out / "late", rank=8, alpha=8, seed=3, rslora=True),
    }


@pytest.fixture(scope="module")
def expected(adapters: dict[str, Path]) -> dict[str | None, list[str]]:
    """The offline ``LLM``'s greedy texts per adapter (None: the base model)."""
    from inferflow import LLM, SamplingParams

    llm = LLM(lora_adapters={k: str(v) for k, v in adapters.items()}, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {name: [o.outputs[0].text for o in llm.generate(PROMPTS, params, lora=name)]
           for name in (None, "sql", "chat", "late")}
    assert len({tuple(v) for v in out.values()}) == 4, "the adapters must change the output"
    return out


@pytest.fixture(scope="module")
def lora_server(
    tmp_path_factory: pytest.TempPathFactory, adapters: dict[str, Path]
) -> Iterator[ServerProcess]:
    traces = tmp_path_factory.mktemp("lora_traces") / "traces.jsonl"
    srv = start_server(
        tmp_path_factory,
        "lora",
        [
            f"lora.adapters.sql={adapters['sql']}",
            f"lora.adapters.chat={adapters['chat']}",
            "lora.allow_runtime_updates=true",
            "lora.max_loras=2",
            "server.num_api_servers=2",
            f"server.api_keys=[{USER_KEY}]",
            f"server.admin_keys=[{ADMIN_KEY}]",
            "tracing=file",
            f"tracing.file_path={traces}",
        ],
    )
    srv.admin_key = ADMIN_KEY  # type: ignore[attr-defined]
    srv.traces_path = traces  # type: ignore[attr-defined]
    yield srv
    srv.terminate()


def _admin(srv: ServerProcess, path: str, body: dict, key: str = ADMIN_KEY) -> httpx.Response:
    return srv.post(path, json=body, headers={"Authorization": f"Bearer {key}"})


def _complete(client: openai.OpenAI, model: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.model == model  # an adapter's responses name the adapter, as vLLM's
        texts.append(out.choices[0].text)
    return texts


def _ids(srv: ServerProcess) -> dict[str, dict]:
    response = srv.get("/v1/models", headers={"Authorization": f"Bearer {USER_KEY}"})
    assert response.status_code == 200
    return {card["id"]: card for card in response.json()["data"]}


def test_models_lists_each_adapter_with_its_parent_and_root(
    lora_server: ServerProcess, adapters: dict[str, Path]
) -> None:
    listed = [m.id for m in lora_server.client(USER_KEY).models.list()]
    assert listed[0] == MODEL and {"sql", "chat"} <= set(listed) and "late" not in listed
    cards = _ids(lora_server)
    for name in ("sql", "chat"):
        assert cards[name]["parent"] == MODEL
        assert cards[name]["root"] == str(adapters[name])
        assert cards[name]["object"] == "model"
    assert "parent" not in cards[MODEL]


def test_greedy_output_per_adapter_equals_the_offline_llm(
    lora_server: ServerProcess, expected: dict[str | None, list[str]]
) -> None:
    client = lora_server.client(USER_KEY)
    for name in (None, "sql", "chat"):
        assert _complete(client, name or MODEL) == expected[name], name
    chat = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "chat" and chat.choices[0].message.content is not None


def test_mixed_concurrent_requests_each_get_their_adapters_output(
    lora_server: ServerProcess, expected: dict[str | None, list[str]]
) -> None:
    """Base and both adapters at once (one engine step mixes them): each answer is its own."""

    async def run() -> list[tuple[str | None, int, str]]:
        client = lora_server.async_client(USER_KEY)

        async def one(name: str | None, i: int) -> tuple[str | None, int, str]:
            out = await client.completions.create(
                model=name or MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )
            return name, i, out.choices[0].text

        jobs = [one(name, i) for _ in range(2) for name in (None, "sql", "chat")
                for i in range(len(PROMPTS))]
        return await asyncio.gather(*jobs)

    for name, i, text in asyncio.run(run()):
        assert text == expected[name][i], (name, i)


def test_unknown_model_is_openais_404(lora_server: ServerProcess) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        lora_server.client(USER_KEY).completions.create(model="nope", prompt="x", max_tokens=1)
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_found"
    assert error["param"] == "model" and "sql" in error["message"]  # adapters are listed


def test_load_during_traffic_then_unload(
    lora_server: ServerProcess, expected: dict[str | None, list[str]], adapters: dict[str, Path]
) -> None:
    """``late`` is loaded while requests for the base and ``sql`` stream: theirs are unaffected;
    ``late`` then answers as offline (in every API process); unloaded, it is a 404."""

    async def traffic(stop: asyncio.Event) -> list[tuple[str | None, int, str]]:
        client = lora_server.async_client(USER_KEY)
        done: list[tuple[str | None, int, str]] = []

        async def loop(name: str | None, i: int) -> None:
            while not stop.is_set() or not done:
                out = await client.completions.create(
                    model=name or MODEL, prompt=PROMPTS[i], max_tokens=MAX_TOKENS,
                    temperature=0, extra_body={"ignore_eos": True},
                )
                done.append((name, i, out.choices[0].text))

        await asyncio.gather(*(loop(n, i) for n in (None, "sql") for i in range(len(PROMPTS))))
        return done

    async def scenario() -> list[tuple[str | None, int, str]]:
        stop = asyncio.Event()
        task = asyncio.create_task(traffic(stop))
        await asyncio.sleep(0.5)
        response = await asyncio.to_thread(
            _admin, lora_server, "/v1/load_lora_adapter",
            {"lora_name": "late", "lora_path": str(adapters["late"])},
        )
        assert response.status_code == 200, response.text
        assert response.text == "Success: LoRA adapter 'late' added successfully."
        await asyncio.sleep(0.5)
        stop.set()
        return await task

    served = asyncio.run(scenario())
    assert len(served) >= 8
    for name, i, text in served:
        assert text == expected[name][i], (name, i)
    cards = _ids(lora_server)
    assert cards["late"]["parent"] == MODEL and cards["late"]["root"] == str(adapters["late"])
    client = lora_server.client(USER_KEY)
    for _ in range(3):  # two API processes: each routes it (shared state, no local list)
        assert _complete(client, "late") == expected["late"]
    metrics = lora_server.get("/metrics", headers={"Authorization": f"Bearer {USER_KEY}"}).text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert families["inferflow:lora_loads"].samples[0].value >= 3  # sql, chat, late
    (info,) = families["vllm:lora_requests_info"].samples
    assert info.labels["max_lora"] == "2"

    response = _admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'late' removed successfully."
    assert "late" not in _ids(lora_server)
    for _ in range(3):
        with pytest.raises(openai.NotFoundError) as info_404:
            client.completions.create(model="late", prompt="x", max_tokens=1)
        body = info_404.value.body
        assert isinstance(body, dict) and body["code"] == "model_not_found"
    again = _admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert again.status_code == 404 and again.json()["error"]["param"] == "lora_name"
    assert _complete(client, "sql") == expected["sql"]  # the others still serve
    metrics = lora_server.get("/metrics", headers={"Authorization": f"Bearer {USER_KEY}"}).text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert families["inferflow:lora_unloads"].samples[0].value >= 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_path": "/x"}, "lora_name"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "x", "lora_path": "/does/not/exist"}, "lora_path"),
        ({"lora_name": MODEL, "lora_path": "/x"}, "lora_name"),  # a served model's name
        ({"lora_name": "sql", "lora_path": "/x"}, "lora_name"),  # already loaded
    ],
)
def test_a_bad_load_is_a_400_naming_the_field(
    lora_server: ServerProcess, body: dict, param: str
) -> None:
    response = _admin(lora_server, "/v1/load_lora_adapter", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_an_adapter_the_engine_refuses_is_a_400(
    lora_server: ServerProcess, tmp_path: Path
) -> None:
    """A DoRA adapter: refused in one line naming the feature, nothing loaded."""
    from inferflow.models.tiny import tiny_llama_path
    from inferflow.testing.lora import make_peft_adapter

    dora = make_peft_adapter(tiny_llama_path(), tmp_path / "dora", rank=4, use_dora=True)
    response = _admin(lora_server, "/v1/load_lora_adapter",
                      {"lora_name": "dora", "lora_path": str(dora)})
    assert response.status_code == 400, response.text
    assert "dora" in response.json()["error"]["message"].lower()
    assert "dora" not in _ids(lora_server)


def test_the_runtime_routes_need_an_admin_key(lora_server: ServerProcess) -> None:
    body = {"lora_name": "x", "lora_path": "/x"}
    assert _admin(lora_server, "/v1/load_lora_adapter", body, key=USER_KEY).status_code == 403
    response = _admin(lora_server, "/v1/unload_lora_adapter", {"lora_name": "sql"}, key=USER_KEY)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "admin_key_required"
    assert lora_server.post("/v1/load_lora_adapter", json=body).status_code == 401
    assert "sql" in _ids(lora_server)


def test_the_adapter_is_on_the_request_span(lora_server: ServerProcess) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = lora_server.post(
        "/v1/completions",
        json={"model": "sql", "prompt": "Hello", "max_tokens": 2},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01",
                 "Authorization": f"Bearer {USER_KEY}"},
    )
    assert response.status_code == 200
    deadline = time.monotonic() + 30  # spans are exported in batches
    while True:
        spans = {s["name"]: s for s in trace_spans(lora_server.traces_path)  # type: ignore[attr-defined]
                 if s["traceId"] == trace_id}
        if {"text_completion sql", "llm_request"} <= set(spans):
            break
        assert time.monotonic() < deadline, sorted(spans)
        time.sleep(0.2)
    for name in ("text_completion sql", "llm_request"):
        attrs = {a["key"]: a["value"] for a in spans[name]["attributes"]}
        assert attrs["inferflow.lora.name"] == {"stringValue": "sql"}, name
    root = {a["key"]: a["value"] for a in spans["text_completion sql"]["attributes"]}
    assert root["gen_ai.request.model"] == {"stringValue": "sql"}  # what the client sent
    assert json.dumps(root["inferflow.model.id"]).count(MODEL) == 1


def test_without_runtime_updates_the_routes_do_not_exist(
    server: ServerProcess,
) -> None:
    """The default server (no ``lora`` adapters, no runtime updates): unknown routes."""
    response = server.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
    assert response.status_code == 404 and "error" in response.json()
    assert server.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
    metrics = server.get("/metrics").text
    assert "vllm:lora_requests_info" not in metrics
