"""The prepared GPU check (issue 45), rehearsed on the CPU: ``gpu_check.sh rehearse`` runs every
check of the GPU run with tiny sizes (the kernels under the Triton interpreter, a real server
and the project's bench) and writes the one JSON; and the wheel folder's list is what the GPU
machine lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a model, a server and the Triton interpreter, end to end (~1 minute)
def test_the_gpu_check_rehearses_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "rehearse", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    checks = result["checks"]
    assert result["device"] == "cpu (rehearsal)"
    assert set(checks) == {
        "parity_float32",
        "parity_bfloat16",
        "kernels",
        "cuda_graph_replay",
        "decode",
        "prefill",
        "serving_c4",
    }
    assert checks["cuda_graph_replay"] == {"ok": None, "skipped": "needs CUDA"}
    assert all(c["ok"] for name, c in checks.items() if name != "cuda_graph_replay")
    assert checks["parity_float32"]["agreeing_tokens"] == [8, 8, 8]
    assert set(checks["kernels"]["max_abs_error"]) == {"decode_float32", "extend_float32"}
    assert (
        checks["decode"]["batch_1"]["tok_s"] > 0
        and checks["decode"]["batch_4"]["bytes_per_step"] > 0
    )
    assert checks["prefill"]["tflop_s"] > 0
    assert checks["serving_c4"]["completed"] == 8 and checks["serving_c4"]["failed"] == 0


def test_the_wheel_folder_holds_what_the_gpu_image_lacks() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_wheels
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    wanted = gpu_wheels.missing_requirements()
    assert {
        "hydra-core",
        "omegaconf",
        "antlr4-python3-runtime",
        "litserve",
        "pyzmq",
        "llguidance",
        "pydantic",
        "pydantic-core",
        "fastapi",
        "uvicorn",
        "opentelemetry-sdk",
    } <= set(wanted)
    assert not {"torch", "triton", "numpy", "onnx", "transformers", "tokenizers"} & set(wanted)
    assert "manylinux_2_31_x86_64" in gpu_wheels.PLATFORMS  # llguidance >= 1.9's only tag
