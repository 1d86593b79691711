"""What ``inferflow tune`` leaves behind: the winner as a ``+tuned=NAME`` config
(:func:`write_tuned`), the report's Markdown (:func:`report_markdown`) and its printed form, the
commands that reproduce and serve the result, and every trial (:func:`write_trials_csv`, the
summary of the served runs: :func:`write_trials_summary`)."""

from __future__ import annotations

import csv
import math
import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from inferflow.experiment.space import format_value
from inferflow.experiment.tune_options import Options
from inferflow.experiment.tune_trial import Trial, goodput_interval, within_interval
from inferflow.experiment.tune_winner import attains


def tuned_text(overrides: Sequence[str], header: Sequence[str] = ()) -> str:
    """A ``# @package _global_`` config holding ``overrides``: group options as defaults-list
    overrides (``override /cache: none``), values as nested keys."""
    groups: list[dict[str, str]] = []
    values: dict[str, Any] = {}
    for item in overrides:
        key, _, raw = item.partition("=")
        if "." not in key:
            groups.append({f"override /{key}": raw})
            continue
        node = values
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw) if raw else raw
    lines = ["# @package _global_", *(f"# {h}" for h in header)]
    body: dict[str, Any] = {}
    if groups:
        body["defaults"] = [*groups, "_self_"]
    body.update(values)
    text = "\n".join(lines) + "\n"
    if body:
        text += yaml.safe_dump(body, sort_keys=False)
    return text


def tuned_dir() -> Path:
    from inferflow.compose import home_conf_dir

    return home_conf_dir() / "tuned"


def write_tuned(name: str, overrides: Sequence[str], header: Sequence[str] = ()) -> Path:
    """``$INFERFLOW_HOME/conf/tuned/NAME.yaml`` (``+tuned=NAME``); returns its path."""
    path = tuned_dir() / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tuned_text(overrides, header))
    return path


def binding_slo(figures: Mapping[str, Any], slos: Mapping[str, float]) -> dict[str, Any] | None:
    """The SLO nearest to (or furthest past) its limit at p99: it is what binds."""
    ratios = {
        m: float(figures[f"p99_{m}_ms"]) / limit
        for m, limit in slos.items()
        if figures.get(f"p99_{m}_ms") is not None
    }
    if not ratios:
        return None
    name = max(ratios, key=lambda m: ratios[m])
    return {
        "slo": name,
        "p99_ms": figures[f"p99_{name}_ms"],
        "limit_ms": slos[name],
        "p99_over_limit": round(ratios[name], 3),
    }


def workload_text(wl: Mapping[str, Any]) -> str:
    rate = wl.get("request_rate")
    load = f"{rate} req/s" if rate is not None and not math.isinf(float(rate)) else "all at once"
    if wl.get("max_concurrency"):
        load += f", at most {wl['max_concurrency']} in flight"
    return (
        f"{wl.get('num_prompts')} prompts of {wl.get('input_len')} -> "
        f"{wl.get('output_len')} tokens, {load}"
    )


def slo_text(slos: Mapping[str, float]) -> str:
    return ", ".join(f"{m} <= {v:g} ms" for m, v in slos.items()) or "no SLO"


def reproduce_command(opts: Options) -> str:
    argv = list(opts.argv)
    if "--seed" not in argv:
        argv += ["--seed", str(opts.seed)]
    return "inferflow tune " + _join(argv)


def serve_command(opts: Options) -> str:
    """How to serve the winner: the base overrides (but how it was measured:
    ``experiment.*``, ``task``) and ``+tuned=NAME``."""
    from inferflow.experiment.served import serve_overrides

    served = serve_overrides(opts.overrides)
    return " ".join(["python -m inferflow", _join(served), f"+tuned={opts.name}"]).replace(
        "  ", " "
    )


def _join(items: Sequence[str]) -> str:
    return " ".join(shlex.quote(i) for i in items)


def fmt_figure(value: Any) -> str:
    """A figure in a log line: three significant digits, ``-`` for none."""
    return "-" if value is None else f"{float(value):.3g}"


def csv_cell(value: Any) -> str:
    """A value in ``trials.csv``: floats to six significant digits, none empty."""
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def report_markdown(report: Mapping[str, Any]) -> str:
    win, dflt = report["winner"], report["default"]
    rows = [
        ("request_goodput", "goodput (req/s)"),
        ("output_throughput", "output tok/s"),
        ("p99_ttft_ms", "p99 TTFT (ms)"),
        ("p99_tpot_ms", "p99 TPOT (ms)"),
        ("p99_e2el_ms", "p99 E2EL (ms)"),
    ]
    lines = [
        f"# inferflow tune: {report['name']}",
        "",
        f"Workload: {workload_text(report['workload'])}; SLO: {slo_text(report['slo_ms'])}.",
        "",
        f"Winner ({report['stage']}): `{' '.join(win['overrides']) or '(the default config)'}`",
        "",
        "| figure | default | winner |",
        "|---|---|---|",
        *(
            f"| {label} | {fmt_figure(dflt.get(k))} | {fmt_figure(win.get(k))} |"
            for k, label in rows
        ),
        "",
    ]
    if report.get("goodput_ratio") is not None:
        lines.append(f"Goodput winner / default: **{report['goodput_ratio']:.2f}x**.")
    if report.get("clear_win") is False:
        lines.append("The difference is within the runs' spread: no clear win over the default.")
    lines += tie_and_capacity_notes(report)
    if report.get("binding_slo"):
        b = report["binding_slo"]
        lines.append(f"Binding SLO: {b['slo']} (p99 {b['p99_ms']:.0f} ms of {b['limit_ms']:g} ms).")
    lines += [
        f"Measurement time: {report['measurement_s']:.0f} s of a {report['budget_s']:.0f} s "
        f"budget ({report['served_runs']} served runs); engine model: {report['model_s']:.0f} s.",
        f"Trials: {report['trials']}.",
        "",
        f"Serve it: `{report['serve_command']}` (file: `{report['tuned_file']}`)",
        f"Reproduce: `{report['reproduce']}`",
        "",
    ]
    return "\n".join(lines)


def tie_and_capacity_notes(report: Mapping[str, Any]) -> list[str]:
    """What limits the ranking: points the winner cannot be told apart from at these repeats
    (their goodput inside its 95 % prediction interval), and a rate past what it serves."""
    notes = []
    tied = report.get("tied_with_winner") or []
    if tied:
        names = ", ".join(
            f"`{' '.join(t['overrides']) or '(default)'}` ({fmt_figure(t['request_goodput'])})"
            for t in tied
        )
        notes.append(
            "Not separable from the winner at these repeats (goodput inside "
            f"its 95 % prediction interval): {names}. More repeats would rank them."
        )
    if report.get("past_capacity"):
        notes.append(
            "The winner serves fewer requests per second than arrive: past capacity the queue "
            "grows through the run and goodput depends on the arrival draw (wide spreads, short "
            "runs that mislead). A lower --request-rate compares configs more reliably."
        )
    return notes


def print_report(report: Mapping[str, Any]) -> None:
    win = report["winner"]
    print(f"winner: {' '.join(win['overrides']) or '(the default config)'}")
    print(
        f"  goodput {fmt_figure(win.get('request_goodput'))} req/s vs default "
        f"{fmt_figure(report['default'].get('request_goodput'))}"
        + (f" ({report['goodput_ratio']:.2f}x)" if report.get("goodput_ratio") else "")
        + (" - within the runs' spread" if report.get("clear_win") is False else "")
    )
    if report.get("binding_slo"):
        b = report["binding_slo"]
        print(f"  binding SLO: {b['slo']} (p99 {b['p99_ms']:.0f} ms of {b['limit_ms']:g} ms)")
    print(
        f"  measurement time {report['measurement_s']:.0f} s (budget {report['budget_s']:.0f} s),"
        f" {report['served_runs']} served runs, model {report['model_s']:.0f} s"
    )
    for note in tie_and_capacity_notes(report):
        print(f"  note: {note}")
    print(f"  serve: {report['serve_command']}")
    print(f"  results: {report['out']} (report.md, trials.csv, summary.*)")


# the figures the report gives of the winner and the default
REPORT_FIGURES = (
    "request_goodput",
    "output_throughput",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "p99_e2el_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "failed",
)


def report_figures(trial: Trial, stage: str | None) -> dict[str, Any]:
    """A trial's figures in the report: measured at ``stage`` (with the goodput's std and 95 %
    prediction half-width), or predicted by the engine model when ``stage`` is None."""
    result = trial.measured.get(stage, {}) if stage else trial.predicted
    out = {k: result.get(k) for k in REPORT_FIGURES if result.get(k) is not None}
    spread = result.get("figures", {}).get("request_goodput") if stage else None
    if spread:
        out["request_goodput_std"] = spread.get("std")
        out["request_goodput_pi95"] = spread.get("pi95")
    return out


# the figures trials.csv records of each trial (predicted; short and confirm: the first, 3rd, 4th)
TRIAL_FIGURES = (
    "request_goodput",
    "slo_attainment",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "p99_e2el_ms",
    "output_throughput",
)


def write_trials_csv(trials: Sequence[Trial], path: Path) -> Path:
    """``trials.csv``: one row per trial, its knobs, predicted and measured figures, state."""
    keys = list(dict.fromkeys(k for t in trials for k in t.point))
    measured = TRIAL_FIGURES[:1] + TRIAL_FIGURES[2:4]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "trial",
                "label",
                "state",
                *keys,
                *(f"predicted_{k}" for k in TRIAL_FIGURES),
                "step_profile",
                *(f"short_{k}" for k in measured),
                *(f"confirm_{k}" for k in measured),
                "measured_s",
                "reason",
            ]
        )
        for t in trials:
            short, confirm = t.measured.get("short", {}), t.measured.get("confirm", {})
            w.writerow(
                [
                    t.number,
                    t.label,
                    t.state,
                    *(format_value(t.point[k]) if k in t.point else "" for k in keys),
                    *(csv_cell(t.predicted.get(k)) for k in TRIAL_FIGURES),
                    t.predicted.get("step_profile", ""),
                    *(csv_cell(short.get(k)) for k in measured),
                    *(csv_cell(confirm.get(k)) for k in measured),
                    csv_cell(sum(t.seconds.values()) if t.seconds else None),
                    t.reason,
                ]
            )
    return path


def write_trials_summary(
    trials: Sequence[Trial], out: Path, title: str, log: Callable[[str], None]
) -> dict[str, Path | None] | None:
    """``summary.{csv,md,png}`` of every served run (None when nothing was served)."""
    from inferflow.experiment.summary import SummaryRow, write_summary

    rows = []
    for t in trials:
        for stage, result in t.measured.items():
            params = {k: format_value(v) for k, v in t.point.items()}
            failed = result.get("failed")
            rows.append(
                SummaryRow.from_result(
                    {**params, "stage": stage},
                    None if failed else result,
                    label=f"{t.label} {stage}",
                    **({"error": failed} if failed else {}),
                )
            )
    if not rows:
        return None
    files = write_summary(rows, out, title=title)
    return {"csv": files.csv, "md": files.md, "png": files.png}


def build_report(
    opts: Options,
    workload: Mapping[str, Any],
    trials: Sequence[Trial],
    default: Trial,
    winner: Trial,
    stage: str | None,
    *,
    tuned_path: Path,
    summary: Mapping[str, Any] | None,
    measure_s: float,
    model_s: float,
    wall_s: float,
    engine_model: Mapping[str, Any],
) -> dict[str, Any]:
    """``report.json``: the winner beside the default measured in the same session (their
    goodput ratio and whether it exceeds the runs' spread), the points it cannot be told apart
    from, which SLO binds, the time spent, and how to serve and reproduce it. ``stage`` None:
    the engine model's prediction (``--simulate-only``)."""
    win, dflt = report_figures(winner, stage), report_figures(default, stage)
    ratio = None
    if win.get("request_goodput") is not None and dflt.get("request_goodput"):
        ratio = float(win["request_goodput"]) / float(dflt["request_goodput"])
    # the default's mean outside the winner's prediction interval (None: no interval to say)
    clear = None
    if ratio is not None and winner is not default and goodput_interval(winner, stage):
        clear = not within_interval(winner, default.measured.get(stage or "", {}), stage)
    # the measured points the winner cannot be told apart from at these repeats
    tied = [
        {"label": t.label, "overrides": t.overrides, "request_goodput": t.goodput(stage)}
        for t in trials
        if stage
        and t is not winner
        and t.goodput(stage) is not None
        and within_interval(winner, t.measured[stage], stage)
    ]
    rate = workload.get("request_rate")
    served = winner.measured.get(stage or "", {}).get("request_throughput") if stage else None
    # past capacity the queue grows through the run and goodput depends on the arrival draw
    overloaded = (
        rate is not None and math.isfinite(float(rate)) and served is not None
        and float(served) < 0.95 * float(rate)
    )  # fmt: skip
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state] = counts.get(t.state, 0) + 1
    measured = stage is not None and winner.goodput(stage) is not None
    return {
        "name": opts.name,
        "workload": dict(workload),
        "slo_ms": opts.slos,
        "slo_attainment": opts.attainment,
        "winner_attains": (
            attains(winner, stage, opts.attainment)
            if measured and stage and opts.attainment is not None
            else None
        ),
        "stage": stage or "simulated",
        "winner": {"overrides": winner.overrides, "label": winner.label, **win},
        "default": dflt,
        "goodput_ratio": ratio,
        "clear_win": clear,
        "tied_with_winner": tied,
        "past_capacity": overloaded,
        "binding_slo": binding_slo(win, opts.slos),
        "measurement_s": round(measure_s, 1),
        "model_s": round(model_s, 1),
        "wall_s": round(wall_s, 1),
        "budget_s": opts.budget_s,
        "served_runs": sum(len(t.measured) for t in trials),
        "trials": counts,
        **engine_model,  # engine_model (the step profiles), calibration
        "tuned_file": str(tuned_path),
        "serve_command": serve_command(opts),
        "reproduce": reproduce_command(opts),
        "summary": {k: str(v) for k, v in summary.items()} if summary else None,
        "out": str(opts.out),
    }
