"""A sweep's runs in one table: ``summary.csv``, ``summary.md`` and ``summary.png``.

One :class:`~inferflow.experiment.summary_rows.SummaryRow` per measured point (a run folder of a Hydra multirun, or a tuner's
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
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from inferflow.experiment.figures import HEADLINE
from inferflow.experiment.summary_rows import (
    Figure,
    SummaryRow,
    collect,
    number_or_none,
    parse_overrides,
)

__all__ = ["Figure", "SummaryRow", "collect", "pareto_front", "parse_overrides", "write_summary"]

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
Y_FIGURE = "output_throughput"  # higher is better
X_FIGURES = ("p99_ttft_ms", "mean_ttft_ms")  # lower is better; the mean where p99 is absent


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates, sorted by x. x is lower-better (TTFT),
    y higher-better (throughput); j dominates i when x_j <= x_i and y_j >= y_i, one strictly.
    Points with a NaN or None coordinate are never on the front."""
    valid = [
        i
        for i, (x, y) in enumerate(points)
        if number_or_none(x) is not None and number_or_none(y) is not None
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
