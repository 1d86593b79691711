"""What a user sees while the server starts: one line says it is up, and only once it is.

uvicorn binds the port and starts the API processes before the engine worker has loaded the
model; its own "Uvicorn running on http://..." and "Application startup complete." would claim a
running server seconds (a large model: minutes) before ``/ready`` turns 200. Those records are
demoted to DEBUG (``inferflow/server/process/uvicorn_logs.py``); ours is printed by the
supervisor once every eager model settled.
"""

from __future__ import annotations

import logging
import re
import time

import pytest
import uvicorn
from server_harness import ServerProcess

from inferflow.server.process.uvicorn_logs import uvicorn_log_config

pytestmark = [pytest.mark.server, pytest.mark.slow]

CLAIMS = ("uvicorn running", "running on http", "application startup complete")
PROGRESS = re.compile(r"engine of \S+: (\d+%|done)")  # build_progress's lines


def lines_before_ready(server: ServerProcess) -> tuple[list[str], str, str]:
    """The lines printed before our ready line, that line, and the whole log."""
    deadline = time.monotonic() + 10
    while "inferflow: ready:" not in server.log():
        assert time.monotonic() < deadline, server.log()[-2000:]
        time.sleep(0.1)  # printed by the supervisor within a poll of /ready turning 200
    log = server.log()
    lines = log.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("inferflow: ready:"))
    return lines[:index], lines[index], log


def test_only_our_ready_line_says_the_server_is_up(default_server: ServerProcess) -> None:
    before, ready, log = lines_before_ready(default_server)
    assert f" at http://127.0.0.1:{default_server.port}/v1 " in ready
    assert "model tiny-llama@1: loading" in before  # the log is the whole start, not a tail
    claims = [line for line in before if any(c in line.lower() for c in CLAIMS)]
    assert claims == []
    assert "Uvicorn running" not in log  # nor later: ours is the only "up" line
    assert log.count("inferflow: ready:") == 1


def test_the_default_engine_builds_without_progress_lines(default_server: ServerProcess) -> None:
    before, _, _ = lines_before_ready(default_server)
    # the fixture's engine folder is fresh: this start built the engine (in well under 2 s)
    assert any("built compiled engine" in line for line in before)
    assert [line for line in before if PROGRESS.search(line)] == []


@pytest.mark.parametrize("level", ["info", "debug"])
def test_uvicorn_start_records_are_debug_only(
    level: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = uvicorn.Config(
        app="unused:app", host="127.0.0.1", port=0, log_level=level, log_config=uvicorn_log_config()
    )
    config.bind_socket().close()
    logging.getLogger("uvicorn.error").error("Address already in use")  # errors pass unchanged
    err = capsys.readouterr().err
    assert "ERROR:    Address already in use" in err
    assert ("DEBUG:    Uvicorn running on http://127.0.0.1:" in err) == (level == "debug")
    assert ("Uvicorn running" in err) == (level == "debug")
