"""Compiled-engine cache: reuse, invalidation on any change, rebuild of corrupt entries."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from engine_factories import make_engine

from inferflow.models.tiny import make_checkpoint
from inferflow.runtimes.step_inputs import EngineRow


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)


def test_second_start_reuses_the_engine(ckpt: Path, tmp_path: Path) -> None:
    first = make_engine(ckpt, cache_dir=str(tmp_path / "engines"))
    second = make_engine(ckpt, cache_dir=str(tmp_path / "engines"))
    assert not first.cache_entry.reused and second.cache_entry.reused
    assert first.cache_entry.path == second.cache_entry.path
    manifest = json.loads((first.cache_entry.path / "manifest.json").read_text())
    for field in ("weights_digest", "builder_version", "onnxruntime_version", "precision",
                  "graph_form", "max_model_len", "files"):
        assert field in manifest


@pytest.mark.parametrize("change", [{"precision": "int8"}, {"graph_form": "canonical"}, {"max_model_len": 128}])
def test_any_setting_change_builds_a_new_engine(ckpt: Path, tmp_path: Path, change: dict) -> None:
    base = make_engine(ckpt, cache_dir=str(tmp_path / "engines"))
    other = make_engine(ckpt, cache_dir=str(tmp_path / "engines"), **change)
    assert not other.cache_entry.reused and other.cache_entry.key != base.cache_entry.key


def test_changed_weights_build_a_new_engine(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, seed=1)
    b = make_checkpoint(tmp_path / "b", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, seed=2)
    ea = make_engine(a, cache_dir=str(tmp_path / "engines"))
    eb = make_engine(b, cache_dir=str(tmp_path / "engines"))
    assert ea.cache_entry.key != eb.cache_entry.key and not eb.cache_entry.reused


@pytest.mark.parametrize("damage", ["truncate_data", "garbage_manifest", "delete_model"])
def test_corrupt_entry_is_rebuilt(ckpt: Path, tmp_path: Path, damage: str) -> None:
    engines = str(tmp_path / "engines")
    good = make_engine(ckpt, cache_dir=engines)
    row = [EngineRow(0, (5, 6, 7), 0, True)]
    expected = good.forward(row)
    entry = good.cache_entry.path
    if damage == "truncate_data":
        data = entry / "model.onnx.data"
        data.write_bytes(data.read_bytes()[:100])
    elif damage == "garbage_manifest":
        (entry / "manifest.json").write_text("{not json")
    else:
        (entry / "model.onnx").unlink()
    rebuilt = make_engine(ckpt, cache_dir=engines)
    assert not rebuilt.cache_entry.reused
    np.testing.assert_array_equal(rebuilt.forward(row), expected)
