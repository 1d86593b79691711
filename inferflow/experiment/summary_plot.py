"""``summary.png``: throughput against TTFT, one point per run, the Pareto front joined.

x = p99 TTFT ms (the mean where no run has a p99), y = output tok/s, error bars = the table's ±
(the 95 % prediction interval of one more repeat, :attr:`~inferflow.experiment.summary.Figure.half_width`);
each point is labelled with its swept values; noisy runs (spread too wide) are drawn
hollow. Drawn with matplotlib's Agg canvas directly (no pyplot: no global figure state, no
display needed); without matplotlib nothing is drawn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol


class PlotTable(Protocol):
    """What the plot reads of ``summary.Table`` (a protocol: this module imports nothing of
    ``summary``, which imports it)."""

    @property
    def rows(self) -> Sequence[Any]: ...  # SummaryRow: .failed, .figures{name: Figure}, ...

    @property
    def x(self) -> str | None: ...

    @property
    def pareto(self) -> Sequence[int]: ...

    def point_label(self, row: Any) -> str: ...


def plot(
    table: PlotTable, path: Path, title: str, y_name: str, headers: Mapping[str, str]
) -> Path | None:
    """Draw the table's runs (x: ``table.x``, y: ``y_name``; axis titles from ``headers``) into
    ``path``; None (nothing written) without matplotlib or without a run that has both."""
    x_name = table.x
    points = [
        (i, row)
        for i, row in enumerate(table.rows)
        if x_name is not None and not row.failed and x_name in row.figures and y_name in row.figures
    ]
    if not points or x_name is None:
        return None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None

    fig = Figure(figsize=(8, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for noisy in (False, True):
        chosen = [(i, r) for i, r in points if (r.spread_ok is False) == noisy]
        if not chosen:
            continue
        xs = [r.figures[x_name] for _, r in chosen]
        ys = [r.figures[y_name] for _, r in chosen]
        ax.errorbar(
            [f.mean for f in xs],
            [f.mean for f in ys],
            xerr=[f.half_width or 0.0 for f in xs],
            yerr=[f.half_width or 0.0 for f in ys],
            fmt="o",
            color="tab:gray" if noisy else "tab:blue",
            mfc="none" if noisy else "tab:blue",
            capsize=3,
            label="noisy (spread too wide)" if noisy else "run",
        )
    for _, row in points:
        ax.annotate(
            table.point_label(row),
            (row.figures[x_name].mean, row.figures[y_name].mean),
            textcoords="offset points",
            xytext=(5, 5),
            fontsize=8,
        )
    front = [table.rows[i] for i in table.pareto]
    if front:
        ax.plot(
            [r.figures[x_name].mean for r in front],
            [r.figures[y_name].mean for r in front],
            "-o",
            color="tab:red",
            mfc="none",
            markersize=12,
            label="Pareto front",
        )
    ax.set_xlabel(headers[x_name] + " (lower is better)")
    ax.set_ylabel(headers[y_name] + " (higher is better)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
