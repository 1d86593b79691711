"""Shared servers for the frontend tests (see ``server_harness``).

Servers are few and shared (session scope) so the suite stays fast on a 2-core machine:
``server`` runs the default graph with an open API; ``limited_server`` has API keys and small
limits so every error path can be reached.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_harness import LIMITED_ADMIN_KEY, LIMITED_KEYS, ServerProcess, start_server


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default graph (tiny model, continuous batching), open API, default limits; traces go
    to ``traces.jsonl`` in the server's folder. Its compiled engine is built afresh in a folder
    of its own (a fraction of a second), so its log shows a first start as a user sees it."""
    folder = tmp_path_factory.mktemp("traces")
    engines = tmp_path_factory.mktemp("default_engines")
    srv = start_server(
        tmp_path_factory,
        "server",
        ["tracing=file", f"tracing.file_path={folder / 'traces.jsonl'}"],
        env={"INFERFLOW_ENGINE_DIR": str(engines)},
    )
    srv.traces_path = folder / "traces.jsonl"  # type: ignore[attr-defined]
    yield srv
    srv.terminate()


@pytest.fixture(scope="session")
def server(default_server: ServerProcess) -> ServerProcess:
    """The default server (ONNX Runtime executor); modules that test both executors override
    this name with ``server_per_executor``."""
    return default_server


@pytest.fixture(params=["onnxruntime", "torch"])
def server_per_executor(request: pytest.FixtureRequest) -> ServerProcess:
    """The default server, then the torch one: a test taking this runs on both executors."""
    name = "default_server" if request.param == "onnxruntime" else "torch_server"
    srv: ServerProcess = request.getfixturevalue(name)
    assert srv.get("/version").json()["engine"]["backend"] == request.param
    return srv


@pytest.fixture(scope="session")
def torch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The default graph on ``executor=torch`` (paged KV, Inductor-compiled), started as a user
    would: ``python -m inferflow executor=torch``."""
    pytest.importorskip("torch")
    srv = start_server(tmp_path_factory, "torch", ["executor=torch", "tracing=off"])
    yield srv
    srv.terminate()


@pytest.fixture(scope="session")
def limited_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """API keys, admin keys, a 4 KiB payload limit, 2 slots + 1 waiting, rate limits, a 1.5 s
    timeout."""
    overrides = [
        f"server.api_keys=[{','.join(LIMITED_KEYS[:-1])}]",
        f"server.admin_keys=[{LIMITED_KEYS[0]}]",  # k-main is both (fine); k-rpm... are not
        "server.max_payload_bytes=4096",
        "server.max_waiting_requests=1",
        "server.rate_limit_requests_per_minute=4",
        "server.rate_limit_tokens_per_minute=3000",
        "server.request_timeout_s=1.5",
        "batching.max_num_seqs=2",
    ]
    # the last key comes from the environment variable, as an operator would pass a secret;
    # so does an admin key that is no API key
    env = {"INFERFLOW_API_KEYS": LIMITED_KEYS[-1], "INFERFLOW_ADMIN_KEYS": LIMITED_ADMIN_KEY}
    srv = start_server(tmp_path_factory, "limited", overrides, env=env)
    srv.admin_key = "k-main"  # type: ignore[attr-defined]
    yield srv
    srv.terminate()
