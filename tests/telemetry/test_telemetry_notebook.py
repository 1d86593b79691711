"""notebooks/trace_analysis.ipynb runs top to bottom, headless, on a trace it generates itself."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from child_env import pythonpath
from nbclient import NotebookClient

from inferflow.telemetry.trace_model import load_spans

pytestmark = pytest.mark.slow

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "trace_analysis.ipynb"
FIGURES = {
    "request_breakdown.png",
    "slowest_request_waterfall.png",
    "span_percentiles.png",
    "engine_steps.png",
}


def test_trace_notebook_executes_on_generated_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plots, demo = tmp_path / "plots", tmp_path / "demo"
    monkeypatch.delenv("INFERFLOW_TRACES_FILE", raising=False)  # forces the generated-trace path
    monkeypatch.delenv("INFERFLOW_TRACE_FILE", raising=False)
    monkeypatch.setenv("INFERFLOW_TRACE_PLOTS", str(plots))
    monkeypatch.setenv("INFERFLOW_TRACE_DEMO_DIR", str(demo))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", pythonpath())  # the kernel imports this checkout
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "demo: 24 simulated requests" in text
    assert "summary: 24 requests" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == len(FIGURES)
    assert {p.name for p in plots.glob("*.png")} == FIGURES
    assert all(p.stat().st_size > 5_000 for p in plots.glob("*.png"))
    spans = load_spans([demo / "demo_traces.jsonl"])
    assert sum(s.name == "llm_request" for s in spans) == 24
