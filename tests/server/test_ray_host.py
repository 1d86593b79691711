"""The Ray host (``server=ray``) on a real 2-node loopback Ray cluster, driven by ``openai``.

The cluster is ``ray.cluster_utils.Cluster`` on 127.0.0.1 (one CPU per node, so the two engine
replicas land on different nodes); the server is started as a user would, joining it with
``server.address``. Skipped when the ``ray`` extra is not installed.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from server_harness import MODEL, ServerProcess, gone, start_server

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported
pytest.importorskip("ray.serve", reason='the Ray host needs the ray extra: pip install "inferflow[ray]"')
from ray.cluster_utils import Cluster

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    yield c
    c.shutdown()


def _ray_server(tmp_path_factory: pytest.TempPathFactory, cluster: Cluster, name: str,
                *overrides: str) -> ServerProcess:
    return start_server(tmp_path_factory, name, [
        "server=ray", f"server.address={cluster.address}", "server.proxy_location=HeadOnly",
        f"server.app_name={name}", *overrides])


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory: pytest.TempPathFactory, cluster: Cluster) -> Iterator[ServerProcess]:
    traces = tmp_path_factory.mktemp("raytraces") / "traces.jsonl"
    srv = _ray_server(tmp_path_factory, cluster, "ray2", "server.num_replicas=2", "tracing=file",
                      f"tracing.file_path={traces}")
    srv.traces_path = traces  # type: ignore[attr-defined]
    srv.wait_until(lambda s: len(s["replicas"]) == 2, timeout=60, what="two replicas reporting")
    yield srv
    assert srv.terminate() == 0, srv.log()[-3000:]


def _replicas(srv: ServerProcess) -> dict[str, dict]:
    return srv.stats()["replicas"]


def _finished(stats: dict) -> float:
    return sum(r["finished_requests"] for r in stats["replicas"].values())


def _after_requests(srv: ServerProcess, before: dict, n: int) -> dict[str, dict]:
    """Per-replica stats once the replicas' reports include ``n`` more finished requests than
    ``before`` (reports reach the ingress up to ~1.5 s after the fact)."""
    return srv.wait_until(lambda s: _finished(s) >= _finished(before) + n, timeout=30,
                          what=f"{n} more finished requests reported")["replicas"]


def test_same_greedy_tokens_as_the_single_node_server(ray_server: ServerProcess,
                                                      default_server: ServerProcess) -> None:
    ours, ref = ray_server.client(), default_server.client()
    for prompt in PROMPTS:
        kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
        want = ref.completions.create(**kwargs).choices[0].text
        assert ours.completions.create(**kwargs).choices[0].text == want
        streamed = "".join(c.choices[0].text for c in ours.completions.create(**kwargs, stream=True))
        assert streamed == want
        chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 12, "temperature": 0.0}
        want_chat = ref.chat.completions.create(**chat).choices[0].message.content
        assert ours.chat.completions.create(**chat).choices[0].message.content == want_chat
        pieces = [c.choices[0].delta.content or "" for c in
                  ours.chat.completions.create(**chat, stream=True) if c.choices]
        assert "".join(pieces) == want_chat


def test_both_replicas_serve_traffic(ray_server: ServerProcess) -> None:
    client = ray_server.client()

    def one(i: int) -> str | None:
        return client.completions.create(model=MODEL, prompt=f"request number {i} " * (1 + i % 3),
                                         max_tokens=24, temperature=0.0).choices[0].finish_reason

    with ThreadPoolExecutor(16) as pool:
        assert set(pool.map(one, range(32))) <= {"length", "stop"}
    stats = ray_server.wait_until(
        lambda s: len(s["replicas"]) == 2
        and all(r["finished_requests"] > 1 for r in s["replicas"].values()),
        timeout=20, what="both replicas having served requests")
    assert stats["engine"]["total_slots"] == sum(r["total_slots"] for r in stats["replicas"].values())


def test_shared_prefix_requests_stay_on_one_replica(ray_server: ServerProcess) -> None:
    client = ray_server.client()
    prefix = " ".join(f"shared context word {i}," for i in range(40))  # many full KV blocks
    ray_server.wait_until(lambda s: s["in_flight"] == 0, timeout=30, what="no request in flight")
    time.sleep(2)  # the last reports of earlier tests have reached the ingress
    before = ray_server.stats()
    for i in range(6):
        client.completions.create(model=MODEL, prompt=f"{prefix} question {i}?", max_tokens=4,
                                  temperature=0.0)
    after = _after_requests(ray_server, before, 6)
    gained = {rid: after[rid]["prefix_cache_hits"] - before["replicas"][rid]["prefix_cache_hits"]
              for rid in after}
    assert sorted(v > 0 for v in gained.values()) == [False, True], gained


def test_metrics_and_version_cover_the_replicas(ray_server: ServerProcess) -> None:
    text = ray_server.get("/metrics").text
    for rid in _replicas(ray_server):
        assert f'replica="{rid}"' in text
    assert ray_server.get("/version").json()["engine"]["backend"] == "onnxruntime"


def _spans_with_resource(path: Path, trace_id: str) -> list[tuple[dict, dict]]:
    """(span, resource attributes) of ``trace_id`` in an OTLP-JSON lines file."""
    found = []
    for line in path.read_text().splitlines() if path.exists() else ():
        for rs in json.loads(line).get("resourceSpans", ()):
            resource = {a["key"]: a["value"].get("stringValue")
                        for a in rs.get("resource", {}).get("attributes", ())}
            for ss in rs.get("scopeSpans", ()):
                found += [(sp, resource) for sp in ss.get("spans", ()) if sp["traceId"] == trace_id]
    return found


def test_one_trace_across_the_ingress_and_the_engine_replica(ray_server: ServerProcess) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = ray_server.post("/v1/completions", headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
                               json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})
    assert response.status_code == 200
    wanted = {"text_completion tiny-llama", "tokenizer", "llm_request", "queue", "compute"}
    deadline = time.monotonic() + 30  # spans are exported in batches
    path: Path = ray_server.traces_path  # type: ignore[attr-defined]
    while True:
        found = _spans_with_resource(path, trace_id)
        if wanted <= {sp["name"] for sp, _ in found}:
            break
        assert time.monotonic() < deadline, sorted({sp["name"] for sp, _ in found})
        time.sleep(0.2)
    by_name = {sp["name"]: (sp, res) for sp, res in found}
    root, _ = by_name["text_completion tiny-llama"]
    assert root["parentSpanId"] == parent_id
    request_span, engine_resource = by_name["llm_request"]
    assert request_span["parentSpanId"] == root["spanId"]  # the engine side joins the trace
    assert engine_resource["service.instance.id"] in _replicas(ray_server)


def test_a_killed_replica_fails_its_requests_explicitly_and_is_replaced(
        ray_server: ServerProcess) -> None:
    client = ray_server.async_client()
    outcomes: list[str] = []
    victims: list[str] = []  # the killed replica's id
    started = threading.Event()

    async def stream(i: int) -> None:
        try:
            out = await client.completions.create(model=MODEL, prompt=f"stream {i}",
                                                  max_tokens=600, temperature=0.0, stream=True,
                                                  extra_body={"ignore_eos": True})
            finish = None
            async for chunk in out:
                started.set()
                finish = chunk.choices[0].finish_reason or finish
            outcomes.append(f"finished:{finish}")
        except openai.APIError as exc:  # explicit: an error status or an SSE error event
            outcomes.append(f"error:{getattr(exc, 'code', None) or exc.message}")

    import asyncio

    async def load() -> None:
        tasks = [asyncio.create_task(stream(i)) for i in range(8)]
        while not started.is_set():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        rid, victim = max(_replicas(ray_server).items(), key=lambda kv: kv[1]["running"])
        victims.append(rid)
        os.kill(int(victim["pid"]), signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)

    asyncio.run(load())
    (dead,) = victims
    assert len(outcomes) == 8, outcomes  # none hung, none lost
    assert all(o in ("finished:length", "error:replica_lost") for o in outcomes), outcomes
    assert any(o == "error:replica_lost" for o in outcomes), outcomes
    ray_server.wait_until(lambda s: len(s["replicas"]) == 2 and dead not in s["replicas"]
                          and s["status"] == "ready", timeout=120,
                          what="the killed replica replaced by a new one")
    sync = ray_server.client()
    assert sync.completions.create(model=MODEL, prompt="after", max_tokens=4).choices[0].text


def test_queue_depth_autoscaling_goes_up_and_back_down(
        tmp_path_factory: pytest.TempPathFactory, cluster: Cluster,
        ray_server: ServerProcess) -> None:
    ray_server.terminate()  # the cluster's two CPUs go to the autoscaled deployment
    srv = _ray_server(tmp_path_factory, cluster, "rayauto", "server.autoscaling.enabled=true",
                      "server.autoscaling.target_per_replica=2",
                      "server.autoscaling.upscale_delay_s=1",
                      "server.autoscaling.downscale_delay_s=3")
    try:
        assert len(srv.wait_until(lambda s: len(s["replicas"]) >= 1, timeout=30)["replicas"]) == 1
        stop = threading.Event()
        client = srv.client()

        def keep_busy(i: int) -> None:
            while not stop.is_set():
                client.completions.create(model=MODEL, prompt=f"busy {i}", max_tokens=300,
                                          extra_body={"ignore_eos": True})

        pool = ThreadPoolExecutor(8)
        for i in range(8):
            pool.submit(keep_busy, i)
        try:
            srv.wait_until(lambda s: len(s["replicas"]) == 2, timeout=90, what="scale up to 2")
        finally:
            stop.set()
            pool.shutdown(wait=True)
        srv.wait_until(lambda s: len(s["replicas"]) == 1, timeout=90, what="scale back to 1")
    finally:
        _sigterm_leaves_nothing(srv)


def test_the_app_builder_for_serve_tooling_and_kuberay_builds_the_same_graph() -> None:
    from ray.serve import Application

    from inferflow.server.ray.app import build

    assert isinstance(build({"overrides": ["tracing=off", "server.num_replicas=2"]}), Application)
    assert isinstance(build({"overrides": '["tracing=off"]'}), Application)  # `serve run` form


def test_a_local_ray_instance_serves_llm_and_embeddings_and_leaves_no_process(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without server.address the server starts Ray itself; SIGTERM takes all of it down."""
    srv = start_server(tmp_path_factory, "raylocal", ["server=ray", "+extra_models=minilm"])
    try:
        client = srv.client()
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].text
        vectors = client.embeddings.create(model="all-minilm-l6-v2", input=["a", "b"]).data
        assert len(vectors) == 2 and len(vectors[0].embedding) == 384
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="Hi", max_tokens=1)
        assert len(srv.tree()) > 3  # Ray's own processes are the server's children
    finally:
        _sigterm_leaves_nothing(srv)


def _sigterm_leaves_nothing(srv: ServerProcess) -> None:
    """SIGTERM alone (before the harness's SIGKILL sweep) ends the server and all it started."""
    tree = srv.tree()
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(90)
    survivors = gone(tree, timeout=30)
    srv.terminate()
    assert code == 0, srv.log()[-3000:]
    assert not survivors, survivors
