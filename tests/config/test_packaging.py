"""conf/ ships inside the wheel as the package ``inferflow.conf`` (pkg://inferflow.conf)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from cfg_helpers import REPO


@pytest.mark.slow
def test_wheel_contains_the_config_tree(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy: the shared checkout gets no build/ or egg-info
    shutil.copytree(
        REPO,
        src,
        ignore=shutil.ignore_patterns(
            ".git",
            "__pycache__",
            "*.egg-info",
            "build",
            "compiled_engines",
            "notebooks",
            ".mypy_cache",
            ".pytest_cache",
            "tests",
            "benchmarks",
        ),
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("inferflow-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "inferflow/conf/" + str(p.relative_to(REPO / "conf"))
        for p in (REPO / "conf").rglob("*")
        if p.is_file() and p.suffix in (".yaml", ".py")
    }
    assert "inferflow/conf/config.yaml" in expected
    assert expected <= names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "inferflow = inferflow.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
