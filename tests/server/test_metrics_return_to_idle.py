"""Every gauge in /metrics returns to its idle value after load with cancellations, timeouts
and a worker restart (a gauge is only as true as its last write: the engine writes it after
every loop iteration, not only after steps)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL, ServerProcess, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

GAUGES_IDLE = {
    "vllm:num_requests_running": 0.0,
    "vllm:num_requests_waiting": 0.0,
    "vllm:kv_cache_usage_perc": 0.0,
    "inferflow:kv_cache_blocks_used": 0.0,
}
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True}


@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory, "gauges", ["server.request_timeout_s=1.0"])
    yield srv
    srv.terminate()


def gauges(srv: ServerProcess) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(srv.get("/metrics").text):
        for sample in family.samples:
            if sample.name in GAUGES_IDLE:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def test_gauges_return_to_idle_after_load_cancels_timeouts_and_a_restart(
    timeout_server: ServerProcess,
) -> None:
    srv = timeout_server
    results: list[int] = []

    def post(body: dict) -> None:
        results.append(srv.post("/v1/completions", json=body).status_code)

    load = [threading.Thread(target=post, args=({**LONG, "max_tokens": 12},)) for _ in range(6)]
    load.append(threading.Thread(target=post, args=(LONG,)))  # runs past the 1 s timeout: 504
    for t in load:
        t.start()
    with httpx.stream(  # a client that leaves mid-stream: cancelled in the engine
        "POST", srv.url("/v1/completions"), json={**LONG, "stream": True}, timeout=30
    ) as response:
        next(response.iter_lines())
    for t in load:
        t.join(60)
    assert sorted(results) == [200] * 6 + [504]
    srv.wait_until(lambda s: s["engine"]["running"] == 0, what="an idle engine")
    # a worker restart with a request in flight (it fails with a 500)
    worker = srv.stats()["engine"]["worker_pid"]
    crashed = threading.Thread(target=post, args=(LONG,))
    crashed.start()
    srv.wait_until(lambda s: s["engine"]["running"] == 1, what="one running request")
    os.kill(worker, signal.SIGKILL)
    crashed.join(60)
    assert results[-1] == 500
    srv.wait_ready()
    deadline = time.monotonic() + 10
    while (seen := gauges(srv)) != GAUGES_IDLE:  # every gauge present and idle
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)
    assert srv.stats()["engine"]["running"] == 0 and srv.stats()["engine"]["waiting"] == 0


def test_the_kv_memory_is_reported_resident_once_the_background_thread_is_done(
    timeout_server: ServerProcess,
) -> None:
    """The worker serves while its KV memory is made resident; /admin/stats says when it is."""
    stats = timeout_server.wait_until(
        lambda s: s["engine"]["executor"].get("kv_resident") == 1.0,
        timeout=120,
        what="the KV memory made resident",
    )
    assert set(stats["engine"]["executor"]) == {"kv_resident"}
