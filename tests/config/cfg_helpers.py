"""Helpers shared by the config tests (a uniquely named module: conftest is not importable)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "plugins"
PII_PLUGIN = PLUGINS / "pii_redactor"
PII_CONF = PII_PLUGIN / "inferflow_pii_redactor" / "conf"
ISOLATED_VARS = (
    "INFERFLOW_CONFIG_PATH",
    "INFERFLOW_ALLOWED_TARGETS",
    "INFERFLOW_MODELS_DIR",
    "INFERFLOW_TRACES_FILE",
    "HYDRA_FULL_ERROR",
    "HF_HUB_CACHE",
)


def run_cli(
    args: Sequence[str], env: dict[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m inferflow ARGS`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "inferflow", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def pip_install_copy(plugin: Path, root: Path) -> Path:
    """``plugin`` really pip-installed (built from a copy under ``root``, so the shared checkout
    gets no build/ or egg-info) into the private site folder ``root/site``, returned."""
    import shutil

    src, site = root / "src", root / "site"
    shutil.copytree(plugin, src)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return site
