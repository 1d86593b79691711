"""Fixtures for the experiment tests: an isolated environment for ``python -m inferflow`` runs
(the suite's INFERFLOW_HOME, so the embedded tiny model is generated once; no plugin variables
inherited) and an empty working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from child_env import pythonpath

ISOLATED_VARS = (  # as tests/config/cfg_helpers.py
    "INFERFLOW_CONFIG_PATH",
    "INFERFLOW_ALLOWED_TARGETS",
    "INFERFLOW_MODELS_DIR",
    "INFERFLOW_TRACES_FILE",
    "HYDRA_FULL_ERROR",
    "HF_HUB_CACHE",
)


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED_VARS}
    env.update(
        PYTHONPATH=pythonpath(base=env),
        HF_HOME=str(tmp_path / "hf"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    return env


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty current directory for CLI runs (checked for litter)."""
    path = tmp_path / "cwd"
    path.mkdir()
    return path
