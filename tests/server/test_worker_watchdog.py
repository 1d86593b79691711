"""A stalled engine worker (SIGSTOP) is noticed: readiness turns 503, the watchdog kills and
restarts it, its in-flight streams end with an explicit error, and the server serves again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from server_harness import MODEL, ServerProcess, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

STALL_S, WATCHDOG_S = 2.0, 5.0  # short limits (defaults: 10 s and 30 s)


@pytest.fixture(scope="module")
def watched_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory,
        "watchdog",
        [f"server.worker_stall_timeout_s={STALL_S}", f"server.worker_watchdog_s={WATCHDOG_S}"],
    )
    yield srv
    srv.terminate()


def test_a_stopped_worker_turns_unready_then_is_restarted(watched_server: ServerProcess) -> None:
    srv = watched_server
    worker = srv.stats()["engine"]["worker_pid"]
    body = {
        "model": MODEL,
        "prompt": "Once",
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(worker, signal.SIGSTOP)  # hung: no step, no heartbeat, no crash
        try:
            deadline = time.monotonic() + 20
            while srv.get("/ready").status_code != 503:
                assert time.monotonic() < deadline, "readiness never noticed the stalled worker"
                time.sleep(0.2)
            assert srv.get("/ready").json()["status"] in ("stalled", "not_ready")
            rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        finally:
            with contextlib.suppress(ProcessLookupError):  # if the watchdog did not act
                os.kill(worker, signal.SIGCONT)
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["error"]["code"] == "worker_crashed"  # explicit, not a cut
    srv.wait_ready()
    assert srv.stats()["engine"]["worker_pid"] not in (0, worker)
    out = srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert out.choices[0].finish_reason == "length"
    assert "gave no heartbeat" in srv.log()
