"""One table across a sweep's runs: the Pareto front, the table from results folders (swept
columns, spread flags, old and failed runs), and a real offline sweep through the CLI."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from inferflow.experiment.callback import SweepSummary
from inferflow.experiment.summary import (
    SummaryRow,
    collect,
    pareto_front,
    parse_overrides,
    write_summary,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- the Pareto front -------------------------------------------------------------------------


def test_pareto_front_keeps_the_points_nothing_beats_on_both_axes() -> None:
    points = [
        (10.0, 100.0),  # 0: fastest TTFT
        (20.0, 300.0),  # 1: on the front
        (20.0, 250.0),  # 2: same TTFT as 1, less throughput: dominated
        (30.0, 300.0),  # 3: same throughput as 1, slower: dominated
        (40.0, 500.0),  # 4: most throughput
        (35.0, 200.0),  # 5: dominated by 1
    ]
    assert pareto_front(points) == [0, 1, 4]  # sorted by TTFT


def test_pareto_front_edge_cases() -> None:
    assert pareto_front([]) == []
    assert pareto_front([(5.0, 5.0)]) == [0]
    assert pareto_front([(1.0, 1.0), (1.0, 1.0)]) == [0, 1]  # equal points: neither dominates
    assert pareto_front([[1.0, 1.0], [1.0, 1.0]]) == [0, 1]  # type: ignore[list-item]  # lists too
    assert pareto_front([(math.nan, 1e9), (2.0, 1.0)]) == [1]  # NaN never on the front
    assert pareto_front([(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]) == [0, 1, 2]  # a trade-off
    assert pareto_front([(3.0, 1.0), (2.0, 2.0), (1.0, 3.0)]) == [2]  # one beats all


def test_overrides_become_params() -> None:
    assert parse_overrides(
        ["batching=static", "+experiment=batching_sweep", "++a.b=[1,2]", "~cache", "junk"]
    ) == {"batching": "static", "experiment": "batching_sweep", "a.b": "[1,2]", "cache": "~"}


# --- the table from results folders -----------------------------------------------------------


def result(tp: float, ttft: float, *, ok: bool = True, overrides: list[str]) -> dict[str, Any]:
    """A results.json in the measured_result layout (two repeats)."""
    figures = {
        "output_throughput": {"mean": tp, "std": tp / 50, "cv": 0.02, "n": 2, "pi95": tp / 5},
        "request_throughput": {"mean": tp / 8, "std": tp / 400, "cv": 0.02, "n": 2},
        "p99_ttft_ms": {"mean": ttft, "std": 1.5, "cv": 1.5 / ttft, "n": 2},
    }
    note = None if ok else "spread too wide to compare (output_throughput varies 40%)"
    return {
        "overrides": overrides,
        "task": "offline",
        "repeats": 2,
        "warmup": 1,
        "figures": figures,
        "spread": {"ok": ok, "max_spread": 0.1, "wide": [] if ok else ["x"], "note": note},
        "machine": {"cores": 2, "cpu_busy_pct": 42.5, "loadavg_1m": 1.0},
        **{k: v["mean"] for k, v in figures.items()},
    }


def make_sweep(root: Path) -> Path:
    """Five run folders: three measured (one noisy), one old-style, one that failed."""
    sweep = root / "sweep"
    common = ["+experiment=batching_sweep", "experiment.repeats=2"]
    runs: list[tuple[str, dict[str, Any] | None, list[str]]] = [
        ("0_a", result(100, 50, overrides=[*common, "batching.max_num_seqs=1"]), []),
        ("1_b", result(300, 80, ok=False, overrides=[*common, "batching.max_num_seqs=4"]), []),
        ("2_c", result(250, 120, overrides=[*common, "batching.max_num_seqs=16"]), []),
        # before issue 42: flat keys only, no overrides recorded (Hydra's overrides.yaml has them)
        (
            "3_d",
            {"output_throughput_tok_s": 90.0, "mean_ttft_ms": 40.0},
            [*common, "batching.max_num_seqs=2"],
        ),
        ("10_e", None, [*common, "batching.max_num_seqs=32"]),  # interrupted: no results.json
    ]
    for name, data, hydra_overrides in runs:
        run = sweep / name
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(json.dumps(hydra_overrides))
        if data is not None:
            (run / "results.json").write_text(json.dumps(data))
    (sweep / "multirun.yaml").write_text("{}")
    return sweep


def test_collect_reads_every_run_in_job_order(tmp_path: Path) -> None:
    rows = collect(make_sweep(tmp_path))
    assert [r.label for r in rows] == ["0", "1", "2", "3", "10"]
    assert [r.status for r in rows] == ["ok", "noisy", "ok", "?", "failed"]
    assert [r.params["batching.max_num_seqs"] for r in rows] == ["1", "4", "16", "2", "32"]
    old = rows[3]
    assert old.figures["output_throughput"].mean == 90.0  # the old key, renamed
    assert old.figures["output_throughput"].std is None
    assert "no results.json" in (rows[4].note or "")


def test_summary_files_from_a_sweep_folder(tmp_path: Path) -> None:
    sweep = make_sweep(tmp_path)
    files = write_summary(sweep, sweep, title="batching")
    assert (files.csv, files.md, files.png) == (
        sweep / "summary.csv",
        sweep / "summary.md",
        sweep / "summary.png",
    )
    # the front: run 0 (fastest TTFT of p99 runs) and run 1 (most throughput); run 2 is beaten
    # by run 1; the old run has no p99 TTFT and the failed run no figures: neither is plotted
    assert files.pareto == [0, 1]

    with files.csv.open() as stream:
        table = list(csv.DictReader(stream))
    assert [r["batching.max_num_seqs"] for r in table] == ["1", "4", "16", "2", "32"]
    assert "experiment.repeats" not in table[0]  # the same in every run: not a column
    assert [r["status"] for r in table] == ["ok", "noisy", "ok", "?", "failed"]
    assert [r["pareto"] for r in table] == ["1", "1", "0", "0", "0"]
    assert float(table[1]["output_throughput"]) == 300.0
    assert float(table[1]["output_throughput_std"]) == 6.0
    assert float(table[1]["output_throughput_pi95"]) == 60.0  # what the Markdown's ± shows
    assert table[3]["output_throughput"] == "90.0" and table[3]["output_throughput_std"] == ""
    assert table[4]["output_throughput"] == "" and "no results.json" in table[4]["note"]
    assert float(table[0]["cpu_busy_pct"]) == 42.5

    text = files.md.read_text()
    assert text == files.text
    assert "fixed in every run: `experiment=batching_sweep`, `experiment.repeats=2`" in text
    header = next(line for line in text.splitlines() if line.startswith("| run"))
    assert header.split(" | ")[1] == "batching.max_num_seqs"
    assert "output tok/s" in header and "p99 TTFT ms" in header and "req/s" in header
    row1 = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    assert "300 ± 60" in row1 and "noisy" in row1 and row1.endswith("| * |")
    assert "± is the 95 % prediction interval of one more repeat" in text
    assert "Pareto front (max output tok/s, min p99 TTFT ms; marked *): run 0, run 1" in text
    assert "- run 1 (max_num_seqs=4): noisy: spread too wide" in text
    assert "- run 10 (max_num_seqs=32): failed: no results.json" in text

    png = files.png.read_bytes() if files.png else b""
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_rows_from_a_tuners_trials_and_no_plot_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [
        SummaryRow.from_result({"max_num_seqs": 8, "chunk": 256}, result(200, 60, overrides=[])),
        SummaryRow.from_result(
            {"max_num_seqs": 64, "chunk": 256}, None, error="KV cache too small"
        ),
    ]
    rows = [SummaryRow(f"trial {i}", r.params, r.figures, r.cpu_busy_pct, r.spread_ok, r.note,
                       r.failed, r.repeats) for i, r in enumerate(rows)]  # fmt: skip
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    files = write_summary(rows, tmp_path, title="tune", prefix="tune_")
    assert files.csv.name == "tune_summary.csv" and files.png is None
    assert not (tmp_path / "tune_summary.png").exists()
    assert "fixed in every run: `chunk=256`" in files.text
    assert "- trial 1 (max_num_seqs=64): failed: KV cache too small" in files.text
    assert "(no plot" in files.text
    assert files.pareto == [0]


# --- the Hydra callback -----------------------------------------------------------------------


def sweep_config(sweep: Path) -> Any:
    return OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})


def test_callback_summarizes_a_measuring_sweep_and_skips_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = make_sweep(tmp_path)
    SweepSummary().on_multirun_end(sweep_config(sweep))
    out = capsys.readouterr().out
    assert "| run | batching.max_num_seqs |" in out and f"summary: {sweep}/summary.csv" in out
    assert (sweep / "summary.md").read_text() in out

    checks = tmp_path / "checks"  # a sweep of task=check: run folders, no results
    (checks / "0_x" / ".hydra").mkdir(parents=True)
    SweepSummary().on_multirun_end(sweep_config(checks))
    assert capsys.readouterr() == ("", "")
    assert sorted(p.name for p in checks.iterdir()) == ["0_x"]


def test_callback_failure_is_one_warning_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = make_sweep(tmp_path)
    (sweep / "summary.csv").mkdir()  # the table cannot be written
    SweepSummary().on_multirun_end(sweep_config(sweep))  # no exception
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "no sweep summary" in captured.err


# --- a real sweep through the command line ----------------------------------------------------


def run_python(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python ARGV`` as a user runs it, its output captured."""
    return subprocess.run(
        [sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip


@pytest.mark.server
@pytest.mark.slow
def test_offline_sweep_ends_with_its_summary(
    cli_env: dict[str, str], workdir: Path, tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "task=offline",
        "batching.max_num_seqs=1,4",
        "offline.num_prompts=4",
        "offline.prompt_len=8",
        "offline.max_tokens=4",
        "experiment.repeats=2",
        "experiment.warmup=0",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = run_python(["-m", "inferflow", *args], cli_env, workdir)
    assert proc.returncode == 0, proc.stderr
    assert "no sweep summary" not in proc.stderr
    with (sweep / "summary.csv").open() as stream:
        table = list(csv.DictReader(stream))
    assert [r["batching.max_num_seqs"] for r in table] == ["1", "4"]
    for row in table:
        assert row["status"] in {"ok", "noisy"}  # measured; how noisy depends on the machine
        assert float(row["output_throughput"]) > 0 and row["output_throughput_std"] != ""
        assert float(row["p99_ttft_ms"]) >= 0 and row["p99_ttft_ms_std"] != ""
        assert row["cpu_busy_pct"] != "" and row["repeats"] == "2"
    assert "1" in {r["pareto"] for r in table}  # someone is on the front
    text = (sweep / "summary.md").read_text()
    assert "fixed in every run:" in text and "`experiment.repeats=2`" in text
    assert text in proc.stdout  # printed at the end of the sweep
    assert proc.stdout.rstrip().endswith(f"{sweep}/summary.png")
    png = (sweep / "summary.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000
    assert list(workdir.iterdir()) == []  # nothing written where the user stood


@pytest.mark.server
@pytest.mark.slow
def test_an_unexpected_error_in_one_point_fails_that_point_and_the_sweep_goes_on(
    cli_env: dict[str, str], workdir: Path, tmp_path: Path
) -> None:
    """A bug (here: the offline task raising for 4 rows) is not a config problem: Hydra alone
    would stop the sweep there and skip the summary. The point is recorded as failed with its
    traceback beside it; the next point runs; the summary lists both; the exit code is 1."""
    sweep = tmp_path / "sweep"
    patch = (
        "import sys, inferflow.experiment.offline as o\n"
        "real = o.run\n"
        "def run(graph, cfg):\n"
        "    if cfg.batching.max_num_seqs == 4:\n"
        "        raise RuntimeError('boom in the task')\n"
        "    return real(graph, cfg)\n"
        "o.run = run\n"
        "from inferflow.cli import main\n"
        "raise SystemExit(main(sys.argv[1:]))\n"
    )
    args = ["-m", "task=offline", "batching.max_num_seqs=4,1", "offline.num_prompts=2",
            "offline.prompt_len=8", "offline.max_tokens=2", "experiment.repeats=1",
            "experiment.warmup=0", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    proc = run_python(["-c", patch, *args], cli_env, workdir)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    broken = next(sweep.glob("0_batching.max_num_seqs=4,*"))
    line = next(x for x in proc.stderr.splitlines() if "boom" in x)
    assert line.startswith("inferflow [task=offline, batching.max_num_seqs=4, ") and line.endswith(
        f"]: RuntimeError: boom in the task (traceback: {broken}/traceback.txt)"
    )
    traceback = (broken / "traceback.txt").read_text()
    assert 'File "<string>", line 5, in run' in traceback  # where it was raised
    assert traceback.rstrip().endswith("RuntimeError: boom in the task")
    failed = json.loads((broken / "results.json").read_text())
    assert failed["failed"] == "RuntimeError: boom in the task"
    measured = json.loads(next(sweep.glob("1_*/results.json")).read_text())
    assert "failed" not in measured and measured["output_throughput"] > 0
    with (sweep / "summary.csv").open() as stream:
        table = list(csv.DictReader(stream))
    assert len(table) == 2
    assert (table[0]["batching.max_num_seqs"], table[0]["status"]) == ("4", "failed")
    assert table[1]["batching.max_num_seqs"] == "1" and table[1]["status"] in {"ok", "noisy"}
