"""Suite-wide setup: nothing touches the user's home, nothing is downloaded (but, on a machine
that has neither Debian's libonnxruntime-dev nor a fetched copy, ONNX Runtime's C headers for the
paged-attention op: 85 kB, once; `.ci/run` fetches them before the suite).

INFERFLOW_HOME (embedded tiny model) and INFERFLOW_ENGINE_DIR (compiled engines) point into one
session temp folder, so the suite starts from a clean machine state and child processes (servers,
CLIs) inherit the same locations.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_SESSION_HOME: Path | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _SESSION_HOME
    import tempfile

    if "INFERFLOW_TEST_KEEP_HOME" not in os.environ:
        _SESSION_HOME = Path(tempfile.mkdtemp(prefix="inferflow-tests-"))
        os.environ["INFERFLOW_HOME"] = str(_SESSION_HOME / "home")
        os.environ["INFERFLOW_ENGINE_DIR"] = str(_SESSION_HOME / "compiled_engines")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(config.option, "dist", "no") == "loadgroup":
        # xdist hands out groups in our order (longest first, see below), not by test count
        config.option.loadscopereorder = False


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    if _SESSION_HOME is not None:
        shutil.rmtree(_SESSION_HOME, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (README's command) a test module runs whole on one
    worker, so its module-scoped server starts once; modules that share a costly session server
    name one ``xdist_group`` (e.g. ``torch_server``: Inductor compiles it on first start) and run
    on the same worker. Workers hand out the longest groups first (the torch_server group, then
    the other modules that start servers), so none is left for the end; without xdist the order
    and the marks change nothing."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
    if hasattr(config, "workerinput"):  # an xdist worker: hand out the long groups first
        items.sort(key=_longest_first)


def _longest_first(item: pytest.Item) -> tuple[bool, bool]:
    group = item.get_closest_marker("xdist_group")
    return (
        group is None or group.args != ("torch_server",),
        item.get_closest_marker("server") is None,
    )
