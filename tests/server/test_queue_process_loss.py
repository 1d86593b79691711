"""The queue (Manager) process is supervised: when it dies, every in-flight stream ends with an
explicit ``queue_lost`` error event, and the server exits with code 1 and one clear log line,
never a traceback, leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from server_harness import MODEL, gone, start_server

from inferflow.server.process_utils import QUEUE_PROCESS_NAME

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _named(pids: list[int], name: str) -> list[int]:
    found = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(pid)
        except OSError:
            continue
    return found


def test_killing_the_queue_process_fails_streams_explicitly_and_exits_cleanly(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    srv = start_server(tmp_path_factory, "queue-loss", [])
    try:
        tree = srv.tree()
        queue_pids = _named(tree, QUEUE_PROCESS_NAME)
        assert len(queue_pids) == 1, "the queue process is named for operators"
        assert _named(tree, "inferflow-llm") and _named(tree, "inferflow-api-0")
        endings: list[list[str]] = []
        started = threading.Barrier(4)

        def stream() -> None:
            body = {"model": MODEL, "prompt": "Once", "max_tokens": 1900, "ignore_eos": True}
            with httpx.stream(
                "POST", srv.url("/v1/completions"), json={**body, "stream": True}, timeout=60
            ) as response:
                lines = (line for line in response.iter_lines() if line.startswith("data: "))
                assert next(lines)
                started.wait(30)
                endings.append([line.removeprefix("data: ") for line in lines])

        threads = [threading.Thread(target=stream) for _ in range(3)]
        for thread in threads:
            thread.start()
        started.wait(30)
        os.kill(queue_pids[0], signal.SIGKILL)
        for thread in threads:
            thread.join(60)
        assert srv.proc.wait(60) == 1
    finally:
        srv.terminate()
    assert len(endings) == 3
    for ending in endings:  # each stream ended with an error event and [DONE], not a cut
        assert ending[-1] == "[DONE]"
        assert json.loads(ending[-2])["error"]["code"] == "queue_lost"
    log = srv.log()
    assert "the queue process" in log and "exited unexpectedly" in log
    assert "Traceback" not in log
    assert not gone(tree, timeout=10), "a child outlived the server"
