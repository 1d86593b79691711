"""benchmarks/engine_profile.py: its per-operator breakdown and floors come out of a real engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


def test_the_profile_splits_each_call_by_operator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.engine_profile import main
    from inferflow.models.tiny import make_checkpoint

    path = make_checkpoint(tmp_path / "m", seed=0)
    monkeypatch.setattr(sys, "argv", ["engine_profile.py", "--checkpoint", str(path), "--rows", "3",
                                      "--prompts", "2", "--repeats", "2", "--context", "40",
                                      "--results-dir", str(tmp_path / "results")])
    assert main() == 0
    result = json.loads((tmp_path / "results" / "engine_profile-m.json").read_text())
    assert list(result["calls"]) == ["decode x1", "decode x3", "prefill 2x256"]
    assert [c["tokens"] for c in result["calls"].values()] == [1, 3, 512]
    for call in result["calls"].values():
        # every call runs the model's projections and its attention, as ONNX Runtime profiled them
        assert call["ops_ms"]["MatMul"] > 0 and call["ops_ms"]["GroupQueryAttention"] > 0
        assert call["wall_ms"] > 0
    floors = result["floors"]
    assert floors["stream_GBps"] > 0 and floors["gemm_M3_GFLOPs"] > 0 and floors["gemm_M2048_GFLOPs"] > 0
    assert "| prefill 2x256 |" in capsys.readouterr().out
