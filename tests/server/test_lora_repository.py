"""LoRA adapters on model-repository entries (issue 43, deliverable 5), on a live server.

Two seeded Llama checkpoints (A: seed 1, B: seed 2) as two repository entries, each with its own
adapter made with peft: ``alpha`` = A (eager, adapter ``a_sql``), ``beta`` = B (on demand,
adapter ``b_sql``, runtime updates on). The oracle is the offline ``LLM`` on the same checkpoint
with the same adapters: each adapter's greedy output must equal it. Then: an adapter of an
on-demand entry loads its base on its first request; a runtime load and unload on ``beta``; its
worker killed, it reloads on the next request or runtime route with exactly the adapters it
served (the runtime load back); the routes refuse loads into an entry without
runtime updates and names another entry's adapter holds.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from server_harness import ServerProcess, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

KEY = "k-lora-repo"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two checkpoints and three adapters: ``a_sql`` of A; ``b_sql`` and ``b_late`` of B."""
    pytest.importorskip("peft")
    from inferflow.models.tiny import make_checkpoint
    from inferflow.testing.lora import make_peft_adapter

    root = tmp_path_factory.mktemp("lora_repo")
    paths = {"A": root / "ckpt-a", "B": root / "ckpt-b"}
    make_checkpoint(paths["A"], seed=1)
    make_checkpoint(paths["B"], seed=2)
    paths["a_sql"] = make_peft_adapter(paths["A"], root / "a_sql", rank=8, alpha=16, seed=11)
    paths["b_sql"] = make_peft_adapter(paths["B"], root / "b_sql", rank=4, alpha=8, seed=12)
    paths["b_late"] = make_peft_adapter(paths["B"], root / "b_late", rank=8, alpha=8, seed=13)
    return paths


@pytest.fixture(scope="module")
def expected(files: dict[str, Path]) -> dict[str, str]:
    """The offline ``LLM``'s greedy text per served name (a base model or an adapter)."""
    from inferflow import LLM, SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict[str, str] = {}
    for base, model, adapters in (("A", "alpha", ["a_sql"]), ("B", "beta", ["b_sql", "b_late"])):
        llm = LLM(files[base], lora_adapters={a: str(files[a]) for a in adapters}, max_loras=2)
        for name in (None, *adapters):
            out[name or model] = llm.generate(PROMPT, params, lora=name)[0].outputs[0].text
        del llm
    assert len(set(out.values())) == len(out), "each adapter must change its base's output"
    return out


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, files: dict[str, Path]
) -> Iterator[ServerProcess]:
    def entry(key: str, path: Path, load: str) -> list[str]:
        return [
            f"+models.{key}.model.path={path}",
            f"+models.{key}.model.name={key}",
            f"+models.{key}.load={load}",
        ]

    overrides = [
        *entry("alpha", files["A"], "eager"),
        f"+models.alpha.lora.adapters.a_sql={files['a_sql']}",
        *entry("beta", files["B"], "on_demand"),
        f"+models.beta.lora.adapters.b_sql={files['b_sql']}",
        "+models.beta.lora.allow_runtime_updates=true",
        "+models.beta.lora.max_loras=2",
        f"server.api_keys=[{KEY}]",
        f"server.admin_keys=[{KEY}]",
        "executor.kv_cache_memory=64MiB",
    ]
    srv = start_server(tmp_path_factory, "lora_repo", overrides)
    srv.admin_key = KEY  # type: ignore[attr-defined]  # for wait_until's /admin/stats
    yield srv
    srv.terminate()


def complete(srv: ServerProcess, model: str) -> str:
    out = srv.client(api_key=KEY).completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert out.model == model
    return out.choices[0].text


def cards(srv: ServerProcess) -> dict[str, dict]:
    response = srv.get("/v1/models", headers=AUTH)
    assert response.status_code == 200, response.text
    return {card["id"]: card for card in response.json()["data"]}


def status(srv: ServerProcess, model_id: str) -> str:
    return str(srv.stats(api_key=KEY)["models"][model_id]["status"])


def test_each_entrys_adapters_are_listed_under_it_before_and_after_its_load(
    server: ServerProcess, files: dict[str, Path], expected: dict[str, str]
) -> None:
    assert status(server, "beta@1") == "unloaded"  # on demand: nothing asked for it yet
    listed = cards(server)
    assert listed["a_sql"]["parent"] == "alpha" and listed["a_sql"]["root"] == str(files["a_sql"])
    assert listed["b_sql"]["parent"] == "beta" and listed["b_sql"]["root"] == str(files["b_sql"])
    # an adapter of an on-demand entry loads its base on its first request
    assert complete(server, "b_sql") == expected["b_sql"]
    assert status(server, "beta@1") == "ready"
    assert complete(server, "a_sql") == expected["a_sql"]
    assert complete(server, "alpha") == expected["alpha"]
    assert complete(server, "beta") == expected["beta"]
    assert {"a_sql", "b_sql"} <= set(cards(server))


def test_runtime_adapters_survive_a_reload_of_their_entry(
    server: ServerProcess, files: dict[str, Path], expected: dict[str, str]
) -> None:
    load = server.post(
        "/v1/load_lora_adapter",
        headers=AUTH,
        json={"lora_name": "b_late", "lora_path": str(files["b_late"])},
    )
    assert load.status_code == 200, load.text
    assert complete(server, "b_late") == expected["b_late"]

    victim = int(server.stats(api_key=KEY)["models"]["beta@1"]["worker_pid"])
    os.kill(victim, signal.SIGKILL)
    server.wait_until(
        lambda s: not s["models"]["beta@1"]["worker_pid"], timeout=60, what="beta's worker gone"
    )
    listed = cards(server)  # while beta has no worker: what it served, the runtime load too
    assert listed["b_late"]["parent"] == "beta" and listed["b_sql"]["parent"] == "beta"
    # a runtime unload while the entry has no worker loads it first (as a request would)
    unload = server.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "b_sql"})
    assert unload.status_code == 200, unload.text
    assert int(server.stats(api_key=KEY)["models"]["beta@1"]["worker_pid"]) not in (0, victim)
    assert complete(server, "b_late") == expected["b_late"]  # restored in the new worker
    with pytest.raises(openai.NotFoundError) as info:
        complete(server, "b_sql")
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"
    assert "b_sql" not in cards(server)
    assert complete(server, "beta") == expected["beta"]
    assert complete(server, "a_sql") == expected["a_sql"]  # the other entry never noticed


def test_runtime_routes_name_the_entry_and_refuse_taken_names(
    server: ServerProcess, files: dict[str, Path]
) -> None:
    into_alpha = server.post(
        "/v1/load_lora_adapter",
        headers=AUTH,
        json={"lora_name": "a_new", "lora_path": str(files["a_sql"]), "model": "alpha"},
    )
    assert into_alpha.status_code == 400, into_alpha.text
    assert into_alpha.json()["error"]["param"] == "model"  # alpha allows no runtime updates
    taken = server.post(
        "/v1/load_lora_adapter",
        headers=AUTH,
        json={"lora_name": "a_sql", "lora_path": str(files["b_late"])},
    )
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "lora_name"
    model_name = server.post(
        "/v1/load_lora_adapter",
        headers=AUTH,
        json={"lora_name": "alpha", "lora_path": str(files["b_late"])},
    )
    assert model_name.status_code == 400 and "served model" in model_name.json()["error"]["message"]
    unload_alpha = server.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "a_sql"})
    assert unload_alpha.status_code == 400 and unload_alpha.json()["error"]["param"] == "lora_name"
    assert "a_sql" in cards(server)
