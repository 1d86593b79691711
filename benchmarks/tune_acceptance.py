#!/usr/bin/env python
"""Issue 42's acceptance run for ``inferflow tune``: does it find a config worth having, cheaply?

    python benchmarks/tune_acceptance.py                  # the ~100M checkpoint (run it on an idle machine)
    python benchmarks/tune_acceptance.py --quick          # the embedded tiny model, a smoke-sized run
    python benchmarks/tune_acceptance.py --request-rate 5 # another fixed rate
    python benchmarks/tune_acceptance.py --space batching.max_num_seqs=4,8,16,32 executor.precision=fp32,int4
                                                          # another space (8 points: half the time)
    python benchmarks/tune_acceptance.py --report benchmarks/results/tune/tune_acceptance.json
                                                          # rewrite the .md from a saved result

Three phases, each through the real command line, on one fixed workload and SLO:

1. **Grid**: ``inferflow tune --grid``: the default config and every point of the space (at most
   16), each served and measured full-length with ``--repeats``; its measurement time is the
   reference.
2. **Tune**: ``inferflow tune`` over the same space with a budget of a third of the grid's
   measurement time (engine profile, calibration, simulated ranking, short runs, confirmations).
3. **Fresh run**: new servers for the default, tune's winner and the grid's best, measured in
   alternating order (``--rounds``), so every comparison is made in one run.

Writes ``benchmarks/results/tune/tune_acceptance[-quick].json`` and ``.md``: goodput of the
winner / the default (the issue asks >= 1.25x), the winner / the grid's best (>= 0.95x), and
tune's measurement time / the grid's (<= 1/3), and whether repeated identical points agree
within the spread the summary reports: every point measured in two phases (grid, tune, fresh
rounds) has each of its single repeats checked against the other phase's 95 % prediction
interval for one more repeat; the point holds unless the misses are more than a calibrated
interval gives by chance (:func:`spread_holds`). If the default meets the SLO at the chosen rate
there is nothing to win: the note says so; raise ``--request-rate``. Far past the machine's
capacity no point meets the SLO either (goodput near 0 everywhere). The rate that separates them
moves with the machine's load: a served run of the default at the rate (``python -m inferflow
+model=local model.path=... task=bench experiment.workload.request_rate=R ...``) tells, and so,
roughly, does ``inferflow tune ... --simulate-only`` (the engine model, uncalibrated). On the
development machine (2 shared cores) the ~100M model's steps cost ~0.35-0.8 ms per token
(``trials.csv``' step model, which varied with the other processes' load).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.peers import MODELS_DIR, checkpoint  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "tune"


def sizes(quick: bool) -> dict[str, Any]:
    """The stated workload, SLO and space of each size."""
    if quick:
        return {
            "model": "tiny",
            "workload": {"input_len": 32, "output_len": 16, "num_prompts": 24, "request_rate": 40},
            "slo": ["ttft:300", "tpot:20"],
            "space": ["batching.max_num_seqs=1,4,16"],
            "repeats": 1,
            "servers": 1,
            "sim_trials": 20,
            "rounds": 1,
        }
    return {
        "model": "100m",
        # a fixed Poisson rate just under what 2 cores give the ~100M model (~3.2 req/s of these
        # requests on 2026-12-07, fp32 or int4) and a TPOT limit the default's 64 rows miss once
        # they fill (p50 TPOT 60-100 ms at this rate); fewer rows keep TPOT inside at the cost
        # of queueing, so the best points sit at a few rows and int4 (probes: fp32 8 rows p99
        # TPOT 47 ms, TTFT 4 s; int4 8 rows 40 ms, 2-2.5 s; the default 121-148 ms)
        "workload": {"input_len": 256, "output_len": 64, "num_prompts": 96, "request_rate": 3},
        "slo": ["ttft:3000", "tpot:50"],
        # 4 x 2 x 2 = 16 points
        "space": [
            "batching.max_num_seqs=4,8,12,16",
            "batching.max_num_batched_tokens=256,2048",
            "executor.precision=fp32,int4",
        ],
        # three repeats per measured point: the fewest for which the 95 % prediction interval the
        # summary reports (Student t, 2 degrees of freedom) is usable
        "repeats": 3,
        # each repeat on its own fresh server (experiment.servers): the reported spread then
        # holds how much a new server's level varies, which the fresh rounds meet (stop 54's
        # run, one server per point: 30 of 32 means inside, the 2 misses one fresh server)
        "servers": 3,
        "sim_trials": 200,
        "rounds": 2,
    }


def tune_cmd(base: list[str], size: dict[str, Any], out: Path, name: str) -> list[str]:
    wl = size["workload"]
    return [
        sys.executable, "-m", "inferflow", "tune", *base,
        "--slo", *size["slo"],
        "--request-rate", str(wl["request_rate"]),
        "--input-len", str(wl["input_len"]), "--output-len", str(wl["output_len"]),
        "--num-prompts", str(wl["num_prompts"]),
        "--space", *size["space"],
        "--repeats", str(size["repeats"]), "--sim-trials", str(size["sim_trials"]),
        "--name", name, "--out", str(out),
    ]  # fmt: skip


def run_tune(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, Any]:
    print("$", " ".join(cmd[2:]), flush=True)
    started = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"inferflow tune failed (exit {proc.returncode}); see {log}")
    out = Path(cmd[cmd.index("--out") + 1])
    report = json.loads((out / "report.json").read_text())
    report["wall_s"] = time.perf_counter() - started
    print("\n".join(log.read_text().strip().splitlines()[-6:]), flush=True)
    return report


def grid_best(out: Path) -> tuple[list[str], float | None]:
    """The grid's best measured point (default included) from its run folders."""
    best: tuple[list[str], float | None] = ([], None)
    for results in sorted((out / "runs").glob("*/results.json")):
        data = json.loads(results.read_text())
        value = data.get("request_goodput")
        if data.get("failed") or value is None:
            continue
        if best[1] is None or float(value) > best[1]:
            best = (list(data.get("overrides", [])), float(value))
    return best


def confirmed(out: Path) -> dict[tuple[str, ...], dict[str, Any]]:
    """A tune folder's full-length (``confirm``) measurements by their sorted overrides."""
    found = {}
    for results in sorted((out / "runs").glob("*_confirm_*/results.json")):
        data = json.loads(results.read_text())
        if not data.get("failed") and "request_goodput" in data.get("figures", {}):
            found[tuple(sorted(data.get("overrides", [])))] = data
    return found


def agreement(
    phases: dict[str, dict[tuple[str, ...], dict[str, Any]]],
) -> list[dict[str, Any]]:
    """Every point measured in two phases: does one phase's goodput fall in the 95 % prediction
    interval the other phase's summary reports for it (both ways)? ``mean_in`` checks the other
    run's mean, ``repeats_in`` counts its single repeats inside (each is a "one more repeat")."""
    from inferflow.experiment.figures import Spread

    checks = []
    names = list(phases)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for key in sorted(set(phases[a]) & set(phases[b])):
                for ref, other in ((a, b), (b, a)):
                    spread = Spread.of(phases[ref][key]["figures"]["request_goodput"]["values"])
                    values = phases[other][key]["figures"]["request_goodput"]["values"]
                    mean = statistics.fmean(values)
                    checks.append({
                        "point": " ".join(key) or "(default)",
                        "interval_from": ref, "measured_in": other,
                        "interval": [spread.mean - (spread.pi95 or 0.0),
                                     spread.mean + (spread.pi95 or 0.0)],
                        "other_mean": mean,
                        "mean_in": spread.admits(mean),
                        "repeats_in": f"{sum(spread.admits(v) for v in values)}/{len(values)}",
                    })  # fmt: skip
    return checks


def fresh_run(
    base: list[str], points: dict[str, list[str]], size: dict[str, Any], out: Path
) -> tuple[dict[str, list[float]], dict[str, dict[tuple[str, ...], dict[str, Any]]]]:
    """New servers for each point, alternating, ``rounds`` times: goodput per round, and each
    round's results by sorted overrides (one phase per round, for :func:`agreement`)."""
    from inferflow.experiment.served import measure_served, tokenizer_of

    rounds: dict[str, dict[tuple[str, ...], dict[str, Any]]] = {}
    slo = {k: float(v) for k, v in (s.split(":") for s in size["slo"])}
    wl = {**size["workload"], "max_concurrency": None, "dataset": "random", "seed": 1}
    goodput: dict[str, list[float]] = {label: [] for label in points}
    for round_no in range(size["rounds"]):
        for label, overrides in points.items():
            result = measure_served(
                [*base, *overrides], wl, slo, repeats=size["repeats"], warmup=1,
                max_spread=0.10, log_dir=out / f"fresh-{label}-r{round_no}",
                tokenizer=tokenizer_of([*base, *overrides]), servers=size["servers"],
            )  # fmt: skip
            value = None if result.get("failed") else result.get("request_goodput")
            print(f"fresh {label} round {round_no}: goodput {value}", flush=True)
            goodput[label].append(float(value) if value is not None else 0.0)
            if value is not None:
                rounds.setdefault(f"fresh round {round_no}", {})[tuple(sorted(overrides))] = result
    return goodput, rounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the tiny model, a smoke-sized run")
    ap.add_argument("--request-rate", type=float, default=None)
    ap.add_argument("--space", nargs="+", default=None, metavar="KEY=VALUES",
                    help="another space (inferflow tune's --space items) for every phase")  # fmt: skip
    ap.add_argument("--out", type=Path, default=None, help="work folder (default: a temp dir)")
    ap.add_argument("--report", type=Path, default=None, metavar="JSON",
                    help="measure nothing: rewrite the Markdown beside a saved result")  # fmt: skip
    args = ap.parse_args(argv)
    if args.report is not None:
        saved = json.loads(args.report.read_text())
        # the spread criterion is recomputed from the saved checks (the other three are ratios)
        saved["acceptance"]["repeated points agree within the reported spread"] = spread_holds(
            saved.get("agreement", [])
        )
        args.report.write_text(json.dumps(saved, indent=2, default=str) + "\n")
        args.report.with_suffix(".md").write_text(markdown(saved))
        print(markdown(saved))
        return 0
    size = sizes(args.quick)
    if args.request_rate is not None:
        size["workload"]["request_rate"] = args.request_rate
    if args.space is not None:
        size["space"] = list(args.space)
    path = checkpoint(size["model"], MODELS_DIR)
    base = ["+model=local", f"model.path={path}", "tracing=off"]
    if size["servers"] > 1:  # tune and the grid measure with it (the server never sees it)
        base.append(f"experiment.servers={size['servers']}")
    work = args.out or Path(tempfile.mkdtemp(prefix="tune-acceptance-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    suffix = "-quick" if args.quick else ""

    grid = run_tune([*tune_cmd(base, size, work / "grid", f"accept-grid{suffix}"), "--grid"],
                    env, work / "grid.log")  # fmt: skip
    budget = max(1.0, grid["measurement_s"] / 3)
    tuned = run_tune(
        [*tune_cmd(base, size, work / "tune", f"accept{suffix}"), "--budget-s", f"{budget:.0f}"],
        env, work / "tune.log",
    )  # fmt: skip
    best_overrides, best_grid = grid_best(work / "grid")
    points = {"default": [], "winner": list(tuned["winner"]["overrides"])}
    if best_overrides != points["winner"]:
        points["grid_best"] = best_overrides
    fresh, fresh_rounds = fresh_run(base, points, size, work)
    checks = agreement(
        {"grid": confirmed(work / "grid"), "tune": confirmed(work / "tune"), **fresh_rounds}
    )
    mean = {k: statistics.fmean(v) if v else 0.0 for k, v in fresh.items()}
    grid_best_fresh = mean.get("grid_best", mean["winner"])
    ratio_default = mean["winner"] / mean["default"] if mean["default"] else math.inf
    ratio_grid = mean["winner"] / grid_best_fresh if grid_best_fresh else math.nan
    time_ratio = tuned["measurement_s"] / grid["measurement_s"] if grid["measurement_s"] else 0.0
    notes = []
    default_attains = (grid["default"].get("request_goodput") or 0.0) >= 0.95 * float(
        size["workload"]["request_rate"]
    )
    if default_attains:
        notes.append("the default meets the SLO at this rate: nothing to win; raise --request-rate")
    result = {
        "size": "quick" if args.quick else "full",
        "model": size["model"],
        "workload": size["workload"],
        "slo": size["slo"],
        "space": size["space"],
        "grid": {"points": grid["trials"], "measurement_s": grid["measurement_s"],
                 "best_overrides": best_overrides, "best_goodput": best_grid},
        "tune": {"winner": tuned["winner"], "measurement_s": tuned["measurement_s"],
                 "budget_s": budget, "served_runs": tuned["served_runs"],
                 "binding_slo": tuned["binding_slo"], "engine_model": tuned["engine_model"]},
        "fresh_goodput": fresh,
        "winner_over_default": ratio_default,
        "winner_over_grid_best": ratio_grid,
        "tune_time_over_grid_time": time_ratio,
        "acceptance": {
            "winner >= 1.25x default": ratio_default >= 1.25,
            "winner >= 0.95x grid best": ratio_grid >= 0.95,
            "tune time <= 1/3 grid time": time_ratio <= 1 / 3 + 1e-9,
            "repeated points agree within the reported spread": spread_holds(checks),
        },
        "agreement": checks,
        "notes": notes,
        "work_dir": str(work),
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"tune_acceptance{suffix}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


#: the level of the prediction interval the summary reports, and of the test of its misses
LEVEL, ALPHA = 0.95, 0.05


def repeat_counts(checks: list[dict[str, Any]]) -> tuple[int, int]:
    """Single repeats inside the other measurement's interval, and repeats compared."""
    counts = [tuple(int(n) for n in c["repeats_in"].split("/")) for c in checks]
    return sum(c[0] for c in counts), sum(c[1] for c in counts)


def misses_p_value(misses: int, total: int, rate: float = 1 - LEVEL) -> float:
    """P(at least ``misses`` misses in ``total`` tries) for an interval that misses at ``rate``:
    the one-sided exact binomial test of "the interval is too narrow"."""
    return sum(
        math.comb(total, k) * rate**k * (1 - rate) ** (total - k) for k in range(misses, total + 1)
    )


def spread_holds(checks: list[dict[str, Any]]) -> bool:
    """Acceptance point 4: repeated identical points agree within the reported spread.

    The summary's ± is a 95 % prediction interval for *one more repeat*, so it is checked as
    such: each single repeat of a point measured again is "one more repeat", and a calibrated
    interval holds 95 % of them. The check fails when the misses are more than chance allows
    (exact binomial test, alpha 0.05): demanding none would fail a calibrated interval most of
    the time (26 comparisons: 0.95**26 = 0.26). Comparisons share repeats, which spreads the
    miss count wider than the binomial's, so the test errs towards failing a good interval."""
    inside, total = repeat_counts(checks)
    return total > 0 and misses_p_value(total - inside, total) >= ALPHA


def coverage(checks: list[dict[str, Any]]) -> str:
    """How often the reported 95 % intervals held the other measurements: the single repeats
    (the acceptance check, :func:`spread_holds`) and the means (shown beside)."""
    means = sum(bool(c["mean_in"]) for c in checks)
    inside, total = repeat_counts(checks)
    if not total:
        return "- no point was measured in two phases: nothing to compare"
    p = misses_p_value(total - inside, total)
    return (f"- inside the other measurement's 95 % interval: {inside} of {total} single repeats "
            f"({100 * inside / total:.1f} %; {total - inside} misses, P(>= that many | a "
            f"calibrated interval) = {p:.2f}, fails below {ALPHA}); {means} of {len(checks)} "
            "means")  # fmt: skip


def markdown(r: dict[str, Any]) -> str:
    wl = r["workload"]
    lines = [
        f"# inferflow tune acceptance ({r['size']}, model {r['model']})",
        "",
        f"Workload: {wl['num_prompts']} random prompts of {wl['input_len']} -> "
        f"{wl['output_len']} tokens at {wl['request_rate']} req/s (Poisson); SLO "
        f"{' '.join(r['slo'])} (ms); space {' '.join(r['space'])}.",
        "",
        "| point | overrides | fresh goodput (req/s, per round) |",
        "|---|---|---|",
    ]
    overrides = {"default": [], "winner": r["tune"]["winner"]["overrides"],
                 "grid_best": r["grid"]["best_overrides"]}  # fmt: skip
    for label, values in r["fresh_goodput"].items():
        shown = " ".join(overrides.get(label, [])) or "(default)"
        lines.append(f"| {label} | `{shown}` | {', '.join(f'{v:.3f}' for v in values)} |")
    lines += [
        "",
        f"- winner / default: **{r['winner_over_default']:.2f}x** (>= 1.25x asked)",
        f"- winner / grid best: **{r['winner_over_grid_best']:.2f}x** (>= 0.95x asked)",
        f"- measurement time: tune {r['tune']['measurement_s']:.0f} s, grid "
        f"{r['grid']['measurement_s']:.0f} s: **{r['tune_time_over_grid_time']:.2f}** (<= 0.33 "
        "asked)",
        f"- binding SLO of the winner: {r['tune']['binding_slo']}",
        "",
        "Repeated identical points (goodput, req/s): the 95 % prediction interval one phase's "
        "summary reports, and the other phase's mean and single repeats inside it:",
        "",
        "| point | interval from | interval | measured in | its mean | mean inside | repeats inside |",
        "|---|---|---|---|---:|---|---|",
        *(
            f"| `{c['point']}` | {c['interval_from']} | {c['interval'][0]:.3f} .. "
            f"{c['interval'][1]:.3f} | {c['measured_in']} | {c['other_mean']:.3f} | "
            f"{'yes' if c['mean_in'] else '**no**'} | {c['repeats_in']} |"
            for c in r.get("agreement", [])
        ),
        "",
        coverage(r.get("agreement", [])),
        f"- acceptance: {r['acceptance']}",
        *(f"- note: {n}" for n in r["notes"]),
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
