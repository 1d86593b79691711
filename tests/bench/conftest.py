"""Fixtures for the load-generator tests: simulated OpenAI servers on 127.0.0.1 (port 0)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from inferflow.testing.fake_server import FakeServer, FakeServerConfig


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    """Factory: ``fake_server(ttft_s=0.05, ...)`` starts a server, stopped at teardown."""
    started: list[FakeServer] = []

    def make(**config: Any) -> FakeServer:
        server = FakeServer(FakeServerConfig(**config)).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()
