"""The environment of the subprocesses tests start (servers, CLIs, scripts).

A child imports *this* checkout's ``inferflow`` (the one the tests import, even where another
copy is installed) and keeps whatever ``PYTHONPATH`` the test run had: entries are prepended,
never replaced.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import inferflow

REPO = Path(inferflow.__file__).resolve().parent.parent


def pythonpath(*extra: str | Path, base: Mapping[str, str] | None = None) -> str:
    """This checkout, then ``extra`` (plugin folders), then ``base``'s ``PYTHONPATH`` (default:
    this process's), without repeats."""
    current = (os.environ if base is None else base).get("PYTHONPATH", "")
    parts = [str(REPO), *map(str, extra), *current.split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment updated with ``extra``; a ``PYTHONPATH`` in ``extra`` is
    added in front of the current one (after this checkout) instead of replacing it."""
    extra = dict(extra or {})
    paths = extra.pop("PYTHONPATH", "").split(os.pathsep)
    return {**os.environ, **extra, "PYTHONPATH": pythonpath(*filter(None, paths))}
