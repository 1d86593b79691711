"""Fixtures for the config / serving-graph / CLI tests.

CLI tests run ``python -m inferflow`` in a subprocess, as users do, with an isolated
environment: a session-wide ``INFERFLOW_HOME`` (the embedded tiny model is generated there
once), an empty models folder and Hugging Face cache, and no plugin variables inherited.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cfg_helpers import ISOLATED_VARS, PLUGINS, pip_install_copy
from child_env import pythonpath


@pytest.fixture(scope="session")
def inferflow_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """INFERFLOW_HOME with the embedded tiny model generated (the suite's, when tests/conftest.py
    set one, so the model is generated once per session)."""
    home = Path(os.environ.get("INFERFLOW_HOME") or tmp_path_factory.mktemp("inferflow_home"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INFERFLOW_HOME", str(home))
        from inferflow.models.tiny import tiny_llama_path

        tiny_llama_path()
    return home


@pytest.fixture(scope="session")
def tiny_checkpoint(inferflow_home: Path) -> Path:
    return next((inferflow_home / "models").glob("tiny_llama-*"))


@pytest.fixture
def config_env(inferflow_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """In-process isolation for compose_config/build_graph: same variables as the CLI tests."""
    for var in ISOLATED_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("INFERFLOW_HOME", str(inferflow_home))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return inferflow_home


@pytest.fixture
def cli_env(inferflow_home: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED_VARS}
    env.update(
        PYTHONPATH=pythonpath(base=env),
        INFERFLOW_HOME=str(inferflow_home),
        HF_HOME=str(tmp_path / "hf"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty current directory for CLI runs (checked for litter by some tests)."""
    path = tmp_path / "cwd"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def installed_priority_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """plugins/priority_batching really pip-installed into a private site folder."""
    site = pip_install_copy(
        PLUGINS / "priority_batching", tmp_path_factory.mktemp("plugin_install")
    )
    yield site
