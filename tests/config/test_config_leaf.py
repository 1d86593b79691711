"""``inferflow/config/`` is a leaf: its modules import nothing of inferflow but ``inferflow.paths``
(so every other package may import the config, and the config never pulls in stages, engines or
the server)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import inferflow.config
from inferflow.config import SLOTS, InferflowConfig, ModelEntryConfig

CONFIG_DIR = Path(inferflow.config.__file__).parent
ALLOWED = ("inferflow.config", "inferflow.paths")


def _inferflow_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            names.add(node.module or "")
    return {n for n in names if n == "inferflow" or n.startswith("inferflow.")}


def test_the_config_package_imports_only_itself_and_paths() -> None:
    files = sorted(CONFIG_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "base.py", "schema.py", "server.py"}
    for path in files:
        for name in _inferflow_imports(path):
            assert name == "inferflow.paths" or name.startswith(ALLOWED), f"{path.name}: {name}"


def test_the_slot_fields_are_the_slots_table() -> None:
    """The root config and a ``models:`` entry have one field per slot, and no other slot."""
    for schema in (InferflowConfig, ModelEntryConfig):
        names = {f.name for f in dataclasses.fields(schema)}
        assert names & set(SLOTS) == set(SLOTS), schema.__name__
        assert all(f.type == "Any" for f in dataclasses.fields(schema) if f.name in SLOTS)
    assert list(InferflowConfig().pipeline) == list(SLOTS)
