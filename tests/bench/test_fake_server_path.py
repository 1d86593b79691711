"""The simulated server's old import path and ``python -m`` command keep working, with a warning."""

from __future__ import annotations

import importlib
import sys

import pytest


def test_old_import_path_warns_and_is_the_same_server() -> None:
    from inferflow.testing import fake_server

    sys.modules.pop("inferflow.bench.fake_server", None)
    with pytest.warns(DeprecationWarning, match="inferflow.testing.fake_server"):
        old = importlib.import_module("inferflow.bench.fake_server")
    assert old.FakeServer is fake_server.FakeServer
    assert old.FakeServerConfig is fake_server.FakeServerConfig
    assert old.main is fake_server.main
