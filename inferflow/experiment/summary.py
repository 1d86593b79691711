"""A sweep's runs in one table: ``summary.csv``, ``summary.md`` and ``summary.png``.

One :class:`SummaryRow` per measured point (a run folder of a Hydra multirun, or a tuner's
trial): the point's parameters, its figures (mean, std; see :mod:`inferflow.experiment.results`),
the machine's CPU use meanwhile and its spread verdict. :func:`write_summary` lays the rows out:

- columns: the swept keys (a key with one value in every row is stated once, as *fixed*), then
  :data:`FIGURES` (those present: mean ± the 95 % prediction interval of one more repeat,
  :attr:`Figure.half_width`), CPU busy %, the spread verdict, the Pareto mark;
- the Pareto front over (p99 TTFT, output throughput) -- lower TTFT and higher throughput are
  better; a point is on the front when no other point is at least as good on both and better on
  one (:func:`pareto_front`);
- notes under the table: noisy runs (spread too wide to compare), failed runs, the front.

Results files from before issue 42 (flat keys only: ``output_throughput_tok_s``,
``mean_ttft_ms``, ...) are read too: their figures have no spread, their TTFT axis is the mean.

Re-summarize a finished or interrupted sweep: ``python -m inferflow.experiment.summary DIR``.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from inferflow.experiment.figures import HEADLINE
from inferflow.experiment.results import RESULTS_NAME, read_result

# The table's figures, in order: the headline ones and the request rate (those present).
FIGURES = (
    "output_throughput",
    "request_throughput",
    "request_goodput",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "p99_e2el_ms",
)
assert set(HEADLINE) <= set(FIGURES)
HEADERS = {
    "output_throughput": "output tok/s",
    "request_throughput": "req/s",
    "request_goodput": "goodput req/s",
    "p99_ttft_ms": "p99 TTFT ms",
    "mean_ttft_ms": "mean TTFT ms",
    "p99_tpot_ms": "p99 TPOT ms",
    "p99_e2el_ms": "p99 E2EL ms",
}
# Keys of results files before issue 42 -> today's names.
LEGACY = {
    "output_throughput_tok_s": "output_throughput",
    "request_throughput_req_s": "request_throughput",
}
Y_FIGURE = "output_throughput"  # higher is better
X_FIGURES = ("p99_ttft_ms", "mean_ttft_ms")  # lower is better; the mean where p99 is absent


@dataclass(frozen=True)
class Figure:
    """One figure of a row: ``std``/``cv``/``pi95`` are None where the result recorded no
    spread (``pi95``: half-width of the 95 % prediction interval for one more repeat)."""

    mean: float
    std: float | None = None
    cv: float | None = None
    pi95: float | None = None

    @property
    def half_width(self) -> float | None:
        """What the table writes after ``±`` and the plot draws as error bars: the 95 %
        prediction interval where the result has one, else the std (older results); None for
        a single repeat (its std of 0 says nothing)."""
        return self.pi95 if self.pi95 is not None else (self.std or None)


@dataclass(frozen=True)
class SummaryRow:
    """One measured point. ``failed``: no results (the run failed, was interrupted, or the
    tuner found it infeasible); ``note`` says why, or what the spread verdict said."""

    label: str
    params: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Figure] = field(default_factory=dict)
    cpu_busy_pct: float | None = None
    spread_ok: bool | None = None  # None: not recorded (old results) or failed
    note: str | None = None
    failed: bool = False
    repeats: int | None = None

    @property
    def status(self) -> str:
        if self.failed:
            return "failed"
        return {True: "ok", False: "noisy", None: "?"}[self.spread_ok]

    @classmethod
    def from_result(
        cls,
        params: Mapping[str, object],
        result: Mapping[str, Any] | None,
        label: str = "",
        error: str | None = None,
    ) -> SummaryRow:
        """A row from a point's parameters and its ``results.json`` dict (None: failed)."""
        values = {str(k): _text(v) for k, v in params.items()}
        if result is None:
            return cls(label, values, note=error or "no results", failed=True)
        if isinstance(result.get("failed"), str):  # a point that did not run (served.py, cli)
            return cls(label, values, note=error or result["failed"], failed=True)
        spread, machine = _mapping(result.get("spread")), _mapping(result.get("machine"))
        notes = [n for n in (spread.get("note"), error) if n]
        ok = spread.get("ok")
        return cls(
            label,
            values,
            _figures(result),
            cpu_busy_pct=_float(machine.get("cpu_busy_pct")),
            spread_ok=ok if isinstance(ok, bool) else None,
            note="; ".join(notes) or None,
            repeats=result.get("repeats") if isinstance(result.get("repeats"), int) else None,
        )

    @classmethod
    def from_overrides(
        cls,
        overrides: Sequence[str],
        result: Mapping[str, Any] | None,
        label: str = "",
        error: str | None = None,
    ) -> SummaryRow:
        """A row from Hydra overrides (``["batching.max_num_seqs=8", ...]``) and a result."""
        return cls.from_result(parse_overrides(overrides), result, label, error)


def parse_overrides(overrides: Sequence[str]) -> dict[str, str]:
    """``key=value`` overrides as a dict (``+key``/``++key`` as ``key``; ``~key`` -> ``~``)."""
    params: dict[str, str] = {}
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if key.startswith("~"):
            key, value = key[1:], "~"
        elif not sep:
            continue
        params[key.lstrip("+")] = value
    return params


def _figures(result: Mapping[str, Any]) -> dict[str, Figure]:
    figures: dict[str, Figure] = {}
    spreads = result.get("figures")
    if isinstance(spreads, Mapping):
        for name, spread in spreads.items():
            if isinstance(spread, Mapping) and _float(spread.get("mean")) is not None:
                mean = float(spread["mean"])
                figures[name] = Figure(
                    mean,
                    _float(spread.get("std")),
                    _float(spread.get("cv")),
                    _float(spread.get("pi95")),
                )
    for key, value in result.items():  # the flat means (and old results' only figures)
        name = LEGACY.get(key, key)
        if name not in figures and _float(value) is not None:
            figures[name] = Figure(float(value))
    return figures


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _float(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


# --- reading a sweep folder -------------------------------------------------------------------


def collect(sweep_dir: Path) -> list[SummaryRow]:
    """One row per run folder of a Hydra multirun dir (a folder with ``results.json`` or
    ``.hydra/``), in job order; a run without results is a failed row."""
    runs = [p for p in Path(sweep_dir).iterdir() if p.is_dir() and _is_run(p)]
    return [_row(run) for run in sorted(runs, key=_job_order)]


def _is_run(path: Path) -> bool:
    return (path / RESULTS_NAME).is_file() or (path / ".hydra").is_dir()


def _job_order(path: Path) -> tuple[int, str]:
    head = path.name.split("_", 1)[0]
    return (int(head) if head.isdigit() else sys.maxsize, path.name)


def _row(run: Path) -> SummaryRow:
    label = run.name.split("_", 1)[0] if run.name.split("_", 1)[0].isdigit() else run.name
    overrides = _hydra_overrides(run)
    path = run / RESULTS_NAME
    if not path.is_file():
        error = f"no {RESULTS_NAME}: the run failed or was interrupted"
        return SummaryRow.from_overrides(overrides, None, label, error)
    try:
        result = read_result(path)
    except (OSError, ValueError) as exc:
        return SummaryRow.from_overrides(
            overrides, None, label, f"unreadable {RESULTS_NAME}: {exc}"
        )
    recorded = result.get("overrides")
    if isinstance(recorded, list):
        overrides = [str(o) for o in recorded]
    return SummaryRow.from_overrides(overrides, result, label)


def _hydra_overrides(run: Path) -> list[str]:
    path = run / ".hydra" / "overrides.yaml"
    try:
        data = yaml.safe_load(path.read_text()) if path.is_file() else None
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


# --- the table --------------------------------------------------------------------------------


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, sorted by x. x is lower-better (TTFT),
    y higher-better (throughput); j dominates i when x_j <= x_i and y_j >= y_i, one strictly.
    Points with a NaN or None coordinate are never on the front."""
    valid = [
        i for i, (x, y) in enumerate(points) if _float(x) is not None and _float(y) is not None
    ]
    # sweep by x ascending (ties: best y first); a point is on the front iff its y beats every
    # y seen so far, or equals the previous front point's (x, y) exactly (a duplicate)
    order = sorted(valid, key=lambda i: (points[i][0], -points[i][1]))
    front: list[int] = []
    best = -math.inf
    for i in order:
        x, y = points[i]
        if y > best or (front and tuple(points[front[-1]]) == (x, y)):
            front.append(i)
            best = max(best, y)
    return front


@dataclass(frozen=True)
class Table:
    """How rows are laid out: which keys vary, which are fixed, which figures show."""

    rows: list[SummaryRow]
    swept: list[str]
    fixed: dict[str, str]
    figures: list[str]
    x: str | None  # the TTFT figure of the Pareto front (None: no row has one)
    pareto: list[int]  # row indices, by x

    @classmethod
    def of(cls, rows: Sequence[SummaryRow]) -> Table:
        rows = list(rows)
        keys = list(dict.fromkeys(k for r in rows for k in r.params))
        with_params = [r for r in rows if r.params]
        fixed: dict[str, str] = {}
        if len(with_params) > 1:
            for key in keys:
                seen = {r.params.get(key) for r in with_params}  # None: a row lacks the key
                value = seen.pop() if len(seen) == 1 else None
                if value is not None:
                    fixed[key] = value
        present = {name for r in rows if not r.failed for name in r.figures}
        x = next((name for name in X_FIGURES if name in present), None)
        figures = [f for f in FIGURES if f in present]
        if x is not None and x not in figures:
            figures.insert(figures.index(Y_FIGURE) + 1 if Y_FIGURE in figures else 0, x)
        points = [_point(r, x) for r in rows]
        pareto = pareto_front(points)  # type: ignore[arg-type]  # None coordinates are skipped
        return cls(rows, [k for k in keys if k not in fixed], fixed, figures, x, pareto)

    def point_label(self, row: SummaryRow) -> str:
        values = [f"{k.rsplit('.', 1)[-1]}={row.params[k]}" for k in self.swept if k in row.params]
        return ", ".join(values) or row.label


def _point(row: SummaryRow, x: str | None) -> tuple[float | None, float | None]:
    if row.failed or x is None or x not in row.figures or Y_FIGURE not in row.figures:
        return (None, None)
    return (row.figures[x].mean, row.figures[Y_FIGURE].mean)


def _number(value: float | None, like: float | None = None) -> str:
    """A figure for people: precision from its magnitude (``like``: the mean a std goes with)."""
    if value is None:
        return ""
    scale = abs(like if like is not None else value)
    digits = 0 if scale >= 100 else 1 if scale >= 10 else 2 if scale >= 0.1 else 4
    return f"{value:.{digits}f}"


def markdown(table: Table, title: str) -> str:
    """The table a person reads, with the notes under it."""
    rows = table.rows
    failed = sum(r.failed for r in rows)
    lines = [f"## {title}", ""]
    head = f"{len(rows)} runs" + (f" ({failed} failed)" if failed else "")
    if table.fixed:
        head += "; fixed in every run: " + ", ".join(f"`{k}={v}`" for k, v in table.fixed.items())
    lines += [head, ""]
    header = ["run", *table.swept, *(HEADERS.get(f, f) for f in table.figures)]
    header += ["CPU busy %", "spread", "Pareto"]
    lines.append("| " + " | ".join(header) + " |")
    texts = 1 + len(table.swept)  # run and swept values left, figures right
    lines.append("|" + "|".join("---" if i < texts else "---:" for i in range(len(header))) + "|")
    for i, row in enumerate(rows):
        cells = [row.label, *(row.params.get(k, "") for k in table.swept)]
        for name in table.figures:
            fig = row.figures.get(name)
            if fig is None or row.failed:
                cells.append("")
            else:
                cells.append(_number(fig.mean) + _plus_minus(fig))
        pareto = "*" if i in table.pareto else ""
        cells += [_number(row.cpu_busy_pct), row.status, pareto]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", *_notes(table)]
    return "\n".join(lines).rstrip() + "\n"


def _plus_minus(fig: Figure) -> str:
    """`` ± h`` (:attr:`Figure.half_width`), or nothing."""
    half = fig.half_width
    return f" ± {_number(half, fig.mean)}" if half is not None else ""


def _notes(table: Table) -> list[str]:
    notes = []
    if any(f.pi95 is not None for r in table.rows for f in r.figures.values()):
        notes.append(
            "± is the 95 % prediction interval of one more repeat of the point "
            "(Student t over its repeats; the std for older results; nothing for one repeat)"
        )
    if table.pareto and table.x is not None:
        runs = ", ".join(_name(table.rows[i]) for i in table.pareto)
        notes.append(
            f"Pareto front (max {HEADERS[Y_FIGURE]}, min {HEADERS[table.x]}; marked *): {runs}"
        )
    for row in table.rows:
        if row.failed or row.spread_ok is False:
            where = f" ({table.point_label(row)})" if table.swept else ""
            notes.append(f"- {_name(row)}{where}: {row.status}: {row.note or 'no note'}")
    if any(r.spread_ok is None and not r.failed for r in table.rows):
        notes.append("- spread ?: the result recorded no repeats' spread (older results file)")
    return notes


def _name(row: SummaryRow) -> str:
    return f"run {row.label}" if row.label.isdigit() else row.label


def write_csv(table: Table, path: Path) -> None:
    """One row per run: the swept keys, then per figure its mean, ``_std`` and ``_pi95``
    (half-width of the 95 % prediction interval of one more repeat) columns."""
    header = ["run", *table.swept, "status", "pareto"]
    for name in table.figures:
        header += [name, f"{name}_std", f"{name}_pi95"]
    header += ["cpu_busy_pct", "repeats", "note"]
    with path.open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(header)
        for i, row in enumerate(table.rows):
            cells: list[object] = [row.label, *(row.params.get(k, "") for k in table.swept)]
            cells += [row.status, int(i in table.pareto)]
            for name in table.figures:
                fig = None if row.failed else row.figures.get(name)
                cells += [fig.mean, fig.std, fig.pi95] if fig is not None else [None] * 3
            cells += [row.cpu_busy_pct, row.repeats, row.note]
            writer.writerow(["" if c is None else c for c in cells])


@dataclass(frozen=True)
class SummaryFiles:
    """What :func:`write_summary` wrote; ``text`` is the Markdown (what a sweep prints)."""

    csv: Path
    md: Path
    png: Path | None  # None: matplotlib is not installed, or no row has both axes' figures
    text: str
    pareto: list[int]  # indices into the rows
    rows: list[SummaryRow]


def write_summary(
    rows: Sequence[SummaryRow] | Path,
    out_dir: Path,
    title: str = "sweep summary",
    prefix: str = "",
) -> SummaryFiles:
    """Write ``{prefix}summary.csv``, ``.md`` and ``.png`` into ``out_dir`` from rows (or from
    a sweep folder's runs, :func:`collect`)."""
    if isinstance(rows, (str, Path)):
        rows = collect(Path(rows))
    table = Table.of(rows)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / f"{prefix}summary.csv", out_dir / f"{prefix}summary.md"
    write_csv(table, csv_path)
    from inferflow.experiment.summary_plot import plot

    png = plot(table, out_dir / f"{prefix}summary.png", title, Y_FIGURE, HEADERS)
    text = markdown(table, title)
    if png is None:
        why = (
            "no run has TTFT and throughput"
            if importlib.util.find_spec("matplotlib")
            else "matplotlib is not installed: pip install 'inferflow[experiments]'"
        )
        text += f"\n(no plot: {why})\n"
    md_path.write_text(text)
    return SummaryFiles(csv_path, md_path, png, text, list(table.pareto), list(table.rows))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m inferflow.experiment.summary SWEEP_DIR [OUT_DIR]``: (re)write a summary."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not 1 <= len(args) <= 2 or args[0].startswith("-"):
        print("usage: python -m inferflow.experiment.summary SWEEP_DIR [OUT_DIR]", file=sys.stderr)
        return 2
    sweep = Path(args[0])
    files = write_summary(sweep, Path(args[1]) if len(args) > 1 else sweep, title=f"sweep {sweep}")
    print(files.text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
