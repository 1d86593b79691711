"""notebooks/benchmark_results.ipynb runs top to bottom, headless, on generated demo data."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from child_env import pythonpath
from nbclient import NotebookClient

pytestmark = pytest.mark.slow

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "benchmark_results.ipynb"


def test_notebook_executes_and_writes_both_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "no-results"
    empty.mkdir()
    plots = tmp_path / "plots"
    demo = tmp_path / "demo"
    monkeypatch.setenv("INFERFLOW_BENCH_DEMO_DIR", str(demo))
    monkeypatch.setenv("INFERFLOW_BENCH_RESULTS", str(empty))  # forces the demo-data path
    monkeypatch.setenv("INFERFLOW_BENCH_PLOTS", str(plots))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", pythonpath())  # the kernel imports this checkout
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "demo: 8 result file(s) generated" in text
    assert len(list(demo.glob("sim-*-c*.json"))) == 8
    assert {p.name for p in plots.glob("*.png")} == {
        "throughput_vs_latency.png",
        "latency_percentiles.png",
    }
    assert all(p.stat().st_size > 10_000 for p in plots.glob("*.png"))
    assert not list(empty.iterdir())  # demo data never lands in the results folder
