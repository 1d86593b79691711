"""Process lifecycle: idle CPU, a crashing worker, SIGTERM drain, and no orphan processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import MODEL, ServerProcess, gone, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
GRACE_S = 1.0


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time consumed so far by the live processes among ``pids``."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def test_one_start_line_once_ready_and_no_poll_access_logs(server: ServerProcess) -> None:
    server.get("/ready")
    server.get("/metrics")
    deadline = time.monotonic() + 10
    while "inferflow: ready:" not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.1)  # the supervisor prints it within a poll of readiness
    log = server.log()
    lines = [line for line in log.splitlines() if line.startswith("inferflow: ready:")]
    assert len(lines) == 1
    line = lines[0]
    assert f"{MODEL} (version 1) at http://127.0.0.1:{server.port}/v1" in line
    assert "executor onnxruntime fp32" in line and "batching continuous (max_num_seqs 64)" in line
    assert "cache prefix" in line and "tracing file " in line
    assert '"GET /ready' not in log and '"GET /metrics' not in log  # polls are not logged


def test_idle_server_uses_almost_no_cpu(server: ServerProcess) -> None:
    server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    server.wait_until(
        lambda s: s["in_flight"] == 0 and s["engine"]["running"] == 0, what="an idle server"
    )
    pids = server.tree()
    assert len(pids) >= 4  # supervisor, Manager, engine worker, API process
    start = cpu_seconds(pids)
    time.sleep(2.0)  # a measurement window, not synchronisation
    used = cpu_seconds(pids) - start
    assert used < 0.2, f"idle server used {used:.2f} s of CPU in 2 s"


@pytest.fixture(scope="module")
def lifecycle_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory, "lifecycle", [f"server.shutdown_grace_s={GRACE_S}"])
    yield srv
    srv.terminate()


def sse_lines(response: httpx.Response) -> Iterator[dict | str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def test_worker_crash_fails_in_flight_requests_and_recovers(
    lifecycle_server: ServerProcess,
) -> None:
    srv = lifecycle_server
    worker = srv.stats()["engine"]["worker_pid"]
    non_streaming: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: non_streaming.append(srv.post("/v1/completions", json=LONG))
    )
    with httpx.stream(
        "POST", srv.url("/v1/completions"), json={**LONG, "stream": True}, timeout=60
    ) as response:
        events = sse_lines(response)
        assert "choices" in next(events)
        thread.start()
        srv.wait_until(lambda s: s["engine"]["running"] == 2, what="two running requests")
        os.kill(worker, signal.SIGKILL)
        rest = list(events)
    thread.join(60)
    # the stream ends with an explicit error event, then [DONE]; not a silent truncation
    assert rest[-1] == "[DONE]"
    assert rest[-2]["error"]["code"] == "worker_crashed" and rest[-2]["error"]["status_code"] == 500
    assert non_streaming[0].status_code == 500
    assert non_streaming[0].json()["error"]["code"] == "worker_crashed"
    _assert_503_while_restarting(srv)
    srv.wait_ready()
    assert srv.stats()["engine"]["worker_pid"] not in (0, worker)
    out = srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert out.choices[0].finish_reason == "length"


def _assert_503_while_restarting(srv: ServerProcess) -> None:
    """A request sent while /ready says not ready (before and after it) gets a 503.

    The replacement worker needs seconds to start (spawn, imports, engine load), so the first
    bracketed attempt normally succeeds; a request that raced the worker's start is retried.
    """
    for _ in range(20):
        assert srv.get("/ready").status_code == 503
        response = srv.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
        )
        if srv.get("/ready").status_code == 503:
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "not_ready" and int(response.headers["retry-after"]) >= 1
            return
        srv.wait_until(lambda s: s["status"] != "ready", what="not ready")
    raise AssertionError("never observed the server while it restarted its worker")


def test_sigterm_drains_in_flight_requests_and_leaves_no_process(
    lifecycle_server: ServerProcess,
) -> None:
    srv = lifecycle_server
    tree = srv.tree()
    assert len(tree) >= 4
    with contextlib.ExitStack() as stack:
        short = stack.enter_context(
            httpx.stream(
                "POST",
                srv.url("/v1/completions"),
                timeout=60,
                json={**LONG, "max_tokens": 16, "stream": True},
            )
        )
        long = stack.enter_context(
            httpx.stream(
                "POST", srv.url("/v1/completions"), timeout=60, json={**LONG, "stream": True}
            )
        )
        short_events, long_events = sse_lines(short), sse_lines(long)
        assert "choices" in next(short_events) and "choices" in next(long_events)
        srv.proc.send_signal(signal.SIGTERM)
        assert _new_connections_are_turned_away(srv) in ("refused", "503")
        short_rest, long_rest = list(short_events), list(long_events)
    # in flight and short: finished normally within the grace period
    assert short_rest[-1] == "[DONE]"
    assert short_rest[-2]["choices"][0]["finish_reason"] == "length"
    # still running when the grace period ran out: failed explicitly
    assert long_rest[-1] == "[DONE]"
    assert long_rest[-2]["error"]["code"] == "shutting_down"
    assert srv.proc.wait(GRACE_S + 30) == 0
    assert gone(tree, timeout=10.0) == [], "processes left behind"


def _new_connections_are_turned_away(srv: ServerProcess) -> str:
    """After SIGTERM: a fresh connection is refused or answered 503 promptly, never left
    hanging on a socket nobody accepts from (a 200 only before the drain began)."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    for _ in range(100):
        try:
            response = httpx.post(srv.url("/v1/completions"), json=body, timeout=3.0)
        except httpx.ConnectError:
            return "refused"
        except httpx.TimeoutException:
            raise AssertionError("a new connection hung during the drain") from None
        if response.status_code == 503:
            return "503"
        time.sleep(0.02)
    raise AssertionError("new connections were still served after SIGTERM")
