"""``inferflow tune``: the config with the most goodput for a workload and its SLOs.

::

    inferflow tune [OVERRIDES...] --slo ttft:2000 tpot:100 --request-rate 4 \\
        --input-len 256 --output-len 64 --num-prompts 64 \\
        --space batching.max_num_seqs=2:64:log executor.precision=fp32,int8 \\
        --budget-s 1800 --name mine          # then: python -m inferflow OVERRIDES +tuned=mine

``OVERRIDES`` compose the base config (the model, anything fixed); the knobs come from the
config schema (``inferflow/config/tunable.py``; ``--list`` prints them), narrowed or re-ranged
by ``--space``. Measurement time is spent where it tells most:

1. **Engine model.** The base config's engine steps are timed on this machine for a few batch
   shapes and a step-time model is fitted (``simulate.profile_engine``; once per distinct
   executor setting, ``--max-profiles``). The default config is measured once, served, with a
   short load; the model is calibrated on it (step-time scale, a per-request overhead).
2. **Simulated search.** Optuna's TPE draws ``--sim-trials`` points (define-by-run: a knob of
   ``speculative=ngram`` only with it); each is composed and checked as ``task=check`` would
   (a point the graph refuses is infeasible, never measured), then the real scheduler replays
   the workload on the model's step times (``simulate.simulate``): predicted goodput, with
   ``--slo-attainment`` as a constraint (``constraints_func``).
3. **Successive halving on served runs** (``served.measure_served``): the best predicted points
   get a short run (a third of the prompts, one repeat); the best third of those, and the
   default, a full-length confirmation with ``--repeats``. A server that does not start, a load
   whose requests all fail: infeasible, never "slow". The winner is the best confirmed goodput;
   of points within 2 % of it (at a fixed rate, all that meet the SLOs), the furthest inside them.

Output in ``--out`` (default ``tune/NAME``): ``trials.csv`` (every point: predicted and measured
figures, state), ``summary.{csv,md,png}`` of the measured runs (``summary.write_summary``),
``runs/*/results.json``, ``report.{md,json}`` (winner beside the default, which SLO binds,
measurement time, the commands), ``tuned.yaml``; and ``$INFERFLOW_HOME/conf/tuned/NAME.yaml``,
which ``python -m inferflow +tuned=NAME`` selects. Exit codes: 0 done, 1 nothing measured, 2 bad
arguments or base config (one line).

The command line is :mod:`~inferflow.experiment.tune_options`; the engine model (profiles,
calibration, predictions) :mod:`~inferflow.experiment.tune_model`; a point and what was measured
of it :mod:`~inferflow.experiment.tune_trial`; the files and report
:mod:`~inferflow.experiment.tune_report`; this module the search (:class:`Tuner`) and ``main``.
"""

from __future__ import annotations

import functools
import json
import math
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from inferflow.config import ConfigError, ExperimentConfig, typed_config
from inferflow.experiment.space import Point, SearchSpace, format_value
from inferflow.experiment.tune_model import EngineModel, check_point
from inferflow.experiment.tune_options import (
    PROG,
    ArgumentError,
    Options,
    parse_args,
    refuse_what_options_set,
)
from inferflow.experiment.tune_report import (
    build_report,
    fmt_figure,
    print_report,
    report_markdown,
    reproduce_command,
    serve_command,
    slo_text,
    workload_text,
    write_trials_csv,
    write_trials_summary,
    write_tuned,
)
from inferflow.experiment.tune_trial import Trial
from inferflow.experiment.tune_winner import measured_winner
from inferflow.interrupts import signal_of, signal_raises

# measure(overrides, workload, goodput, repeats, warmup, log_dir) -> results dict (served.py's)
Measure = Callable[
    [Sequence[str], Mapping[str, Any], Mapping[str, float], int, int, Path], dict[str, Any]
]


def _log(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class Tuner:
    """The search (module doc); ``measure`` is the served measurement (``served.py``'s
    ``measure_served``, or a stand-in in tests)."""

    def __init__(
        self, opts: Options, measure: Measure | None = None, log: Callable[[str], None] = _log
    ) -> None:
        from inferflow.compose import compose_config

        self.opts = opts
        self.log = log
        self.measure_fn = measure
        self.base = compose_config(opts.overrides)
        space = SearchSpace.declared(self.base)
        self.space = space.narrowed(opts.space_items, self.base) if opts.space_items else space
        wl = dict(self.base.experiment.workload)
        wl.update(opts.workload)
        self.workload = wl
        # experiment.* checked (repeats, servers, ... in range) and typed
        self.exp: ExperimentConfig = typed_config(
            ExperimentConfig, self.base.experiment, "experiment"
        )
        refuse_what_options_set(self.exp, opts)
        self.trials: list[Trial] = []
        self.served_s = 0.0  # the served runs
        self.model_s = 0.0  # the simulated search
        self._checked: dict[tuple[str, ...], tuple[Any, Any, str]] = {}
        self.started = time.perf_counter()
        if self.check([])[0] is None:
            raise ConfigError(f"the base config: {self.check([])[2]}")
        self.model = EngineModel(
            self.base, self.space, self.workload, opts.slos, self.check,
            base_overrides=opts.overrides, max_profiles=opts.max_profiles, log=log,
        )  # fmt: skip

    @property
    def measure_s(self) -> float:
        """Measurement time spent: the step profiles and the served runs (what the budget caps)."""
        return self.model.profile_s + self.served_s

    # ------------------------------------------------------------ checking points
    def check(self, overrides: Sequence[str]) -> tuple[Any, Any, str]:
        """(graph, layout, "") for a point the graph accepts, else (None, None, reason); each
        point composed once."""
        key = tuple(overrides)
        if key not in self._checked:
            self._checked[key] = check_point([*self.opts.overrides, *overrides])
        return self._checked[key]

    # ------------------------------------------------------------ served runs
    def measure(self, trial: Trial, stage: str, workload: Mapping[str, Any], repeats: int) -> None:
        fn = self.measure_fn or functools.partial(
            _served_measure,
            servers=int(self.exp.servers),
            max_spread=float(self.exp.max_spread),
            timeout_s=float(self.exp.server_timeout_s),
        )
        run_dir = self.opts.out / "runs" / f"{len(self._run_dirs()):03d}_{stage}_{trial.label}"
        started = time.perf_counter()
        try:
            result = fn(
                [*self.opts.overrides, *trial.overrides],
                workload,
                self.opts.slos,
                repeats,
                int(self.exp.warmup),
                run_dir,
            )
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # a measurement that broke is this point's failure
            result = {"task": "bench", "failed": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        seconds = time.perf_counter() - started
        self.served_s += seconds
        result = {"overrides": [*trial.overrides], **result}
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "results.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        trial.measured[stage], trial.seconds[stage] = result, seconds
        if result.get("failed"):
            trial.state, trial.reason = "failed", str(result["failed"])
            self.log(f"{stage} {trial.label}: failed ({trial.reason}) [{seconds:.0f} s]")
        else:
            self.log(
                f"{stage} {trial.label}: goodput {fmt_figure(result.get('request_goodput'))} req/s,"
                f" p99 ttft {fmt_figure(result.get('p99_ttft_ms'))} ms, p99 tpot "
                f"{fmt_figure(result.get('p99_tpot_ms'))} ms [{seconds:.0f} s]"
            )

    def _run_dirs(self) -> list[Path]:
        runs = self.opts.out / "runs"
        return sorted(runs.iterdir()) if runs.is_dir() else []

    def left_s(self) -> float:
        return self.opts.budget_s - self.measure_s

    # ------------------------------------------------------------ the search
    def new_trial(self, point: Point, label: str = "") -> Trial:
        trial = Trial(len(self.trials), dict(point), SearchSpace.overrides(point))
        trial.label = label or f"t{trial.number}"
        self.trials.append(trial)
        return trial

    def simulated_search(self) -> list[Trial]:
        """Rank points on the engine model (Optuna TPE, constraints); the feasible ones, best
        predicted first, each point once."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        started = time.perf_counter()
        # optuna 5: Trial.set_constraint; 4.x: the sampler's constraints_func
        new_api = hasattr(optuna.trial.Trial, "set_constraint")
        sampler = optuna.samplers.TPESampler(
            seed=self.opts.seed,
            n_startup_trials=min(20, max(5, self.opts.sim_trials // 5)),
            constraints_func=None if new_api else lambda t: t.user_attrs.get("constraint", (1.0,)),
        )
        study = optuna.create_study(direction="maximize", sampler=sampler)
        # only the knobs the model sees: the others would be drawn at random (the model gives
        # every value the same figures) and keep the base's values here (measured_only_variants)
        space = self.space.modelled()
        default = space.default_point(self.base)
        if space.contains(default):
            study.enqueue_trial({k: v for k, v in default.items()}, skip_if_exists=True)
        seen: dict[tuple[str, ...], Trial] = {}
        for _ in range(self.opts.sim_trials if space.knobs else 0):
            ot = study.ask()
            point = space.suggest(ot)
            overrides = SearchSpace.overrides(point)
            key = tuple(overrides)
            if key in seen:
                trial = seen[key]
            else:
                trial = self.new_trial(point)
                figures, reason = self.model.predict(point, overrides)
                trial.predicted = figures
                if reason:
                    trial.state, trial.reason = "infeasible", reason
                seen[key] = trial
            value, violation = self._objective(trial)
            if new_api:
                ot.set_constraint("slo_attainment", violation)
            else:
                ot.set_user_attr("constraint", (violation,))
            study.tell(ot, value)
        self.model_s += time.perf_counter() - started
        ranked = [t for t in seen.values() if t.state == "ok"]
        ranked.sort(key=self._rank_key, reverse=True)
        return ranked

    def _objective(self, trial: Trial) -> tuple[float, float]:
        if trial.state != "ok":
            return 0.0, 1.0
        goodput = float(trial.predicted.get("request_goodput") or 0.0)
        need = self.opts.attainment
        attained = float(trial.predicted.get("slo_attainment") or 0.0)
        return goodput, (need - attained) if need is not None else 0.0

    def _rank_key(self, trial: Trial) -> tuple[float, float, float]:
        """Feasible first; then goodput (to 2%: points that all meet the SLOs at a fixed rate
        tie); then the margin to the nearest SLO."""
        goodput, violation = self._objective(trial)
        slack = -max(
            (trial.predicted.get(f"p99_{m}_ms") or 0.0) / limit
            for m, limit in self.opts.slos.items()
        )
        bucket = math.floor(math.log(goodput) / math.log(1.02)) if goodput > 0 else -math.inf
        return (0.0 if violation > 0 else 1.0), bucket, slack

    def run(self) -> dict[str, Any]:
        """The whole search (module doc); returns the report."""
        opts = self.opts
        opts.out.mkdir(parents=True, exist_ok=True)
        short_wl = {**self.workload, "num_prompts": max(4, int(self.workload["num_prompts"]) // 3)}
        default = self.new_trial({}, "default")
        default.point = self.space.default_point(self.base)  # (its overrides stay empty)
        if opts.grid:
            return self._grid(default)
        if opts.simulate_only:
            self.model.profile(())
            default.predicted, _ = self.model.predict({}, [])
            ranked = self.simulated_search()
            return self.finish(default, ranked[:1], stage=None)
        self.model.profile(())
        self.measure(default, "short", short_wl, 1)
        if default.state == "ok":
            self.model.calibrate(default.measured["short"], short_wl)
        short_cost = default.seconds.get("short", 60.0)
        ranked = self.simulated_search()
        # (the default is measured already, also where the space spells its values out)
        ranked = [t for t in ranked if t.overrides and t.point != default.point]
        k = self._how_many(short_cost)
        self.log(f"{len(ranked)} feasible points ranked on the model; short runs for {k}")
        for trial in ranked[:k]:
            if self.left_s() < short_cost:
                trial.state, trial.reason = "skipped", "measurement budget spent"
                continue
            self.measure(trial, "short", short_wl, 1)
        shorts = [t for t in [default, *ranked[:k]] if t.goodput("short") is not None]
        shorts.sort(key=lambda t: t.goodput("short") or 0.0, reverse=True)
        if shorts and self.space.unmodelled():
            shorts += self.measured_only_variants(shorts[0], short_wl, short_cost)
            shorts = [t for t in shorts if t.goodput("short") is not None]
            shorts.sort(key=lambda t: t.goodput("short") or 0.0, reverse=True)
        shorts = [t for t in shorts if t is not default]  # (confirmed anyway, as the baseline)
        finalists = shorts[: max(1, math.ceil(len(shorts) / 3))]
        for trial in [default, *finalists]:
            self.measure(trial, "confirm", self.workload, opts.repeats)
        return self.finish(default, finalists, stage="confirm")

    def measured_only_variants(
        self, best: Trial, short_wl: Mapping[str, Any], short_cost: float
    ) -> list[Trial]:
        """The knobs the engine model cannot see (``Tunable.simulated`` False: API processes,
        KV block size, speculation), decided by real runs: the best short run's point with one
        such knob at each of its other values, one knob at a time, a short run each while the
        budget lasts (an option's own fields keep their defaults)."""
        variants: list[Trial] = []
        unmodelled = {k.key for k in self.space.unmodelled()}
        # the best's modelled values (the default's point spells out every knob)
        modelled = {k: v for k, v in best.point.items() if k not in unmodelled}
        for knob in self.space.unmodelled():
            if not self.space.active(knob, best.point):
                continue
            current = best.point.get(
                knob.key,
                self.space.base_options.get(knob.slot)
                if knob.group
                else knob.default_of(self.base),
            )
            for value in knob.values():
                if format_value(value) == format_value(current):
                    continue
                point = {**modelled, knob.key: value}
                if knob.group:  # the fields of the option it leaves do not exist any more
                    point = {
                        key: v
                        for key, v in point.items()
                        if all(
                            k.key != key or self.space.active(k, point) for k in self.space.knobs
                        )
                    }
                trial = self.new_trial(point)
                variants.append(trial)
                _, _, reason = self.check(trial.overrides)
                if reason:
                    trial.state, trial.reason = "infeasible", reason
                elif self.left_s() < short_cost:
                    trial.state, trial.reason = "skipped", "measurement budget spent"
                else:
                    self.measure(trial, "short", short_wl, 1)
        return variants

    def variant_count(self) -> int:
        """Short runs :meth:`measured_only_variants` asks for (at the default's options)."""
        point = self.space.default_point(self.base)
        return sum(
            len(k.values()) - 1 for k in self.space.unmodelled() if self.space.active(k, point)
        )

    def _how_many(self, short_cost: float) -> int:
        """Candidates whose short runs, with those of the measured-only knobs and the
        confirmations after them, fit the budget."""
        extra = self.variant_count()
        for k in range(self.opts.top, 0, -1):
            finalists = max(1, math.ceil(k / 3))
            shorts = (k + extra) * short_cost
            if shorts + (finalists + 1) * self.confirm_cost(short_cost) <= self.left_s():
                return k
        return 1

    def confirm_cost(self, short_cost: float) -> float:
        """A confirmation's expected seconds from a short run's: a short run is a server start,
        a warm-up and one load of a third of the prompts, about three units ``u`` of a short
        load each; a confirmation is ``experiment.servers`` x (a start and a full-length
        warm-up) and ``--repeats`` full-length loads, a full load being ``ratio`` units."""
        prompts = int(self.workload["num_prompts"])
        ratio = max(1.0, prompts / max(4, prompts // 3))
        servers = max(1, min(int(self.exp.servers), self.opts.repeats))
        return short_cost / 3 * (servers * (1 + ratio) + self.opts.repeats * ratio)

    def _grid(self, default: Trial) -> dict[str, Any]:
        """Every point of the space, full-length runs (the baseline the tuner is judged by)."""
        self.measure(default, "confirm", self.workload, self.opts.repeats)
        best: list[Trial] = []
        for point in self.space.grid():
            if point == default.point:
                continue  # the default, measured above
            trial = self.new_trial(point)
            _, _, reason = self.check(trial.overrides)
            if reason:
                trial.state, trial.reason = "infeasible", reason
                continue
            self.measure(trial, "confirm", self.workload, self.opts.repeats)
            best.append(trial)
        return self.finish(default, best, stage="confirm")

    # ------------------------------------------------------------ output
    def finish(
        self, default: Trial, finalists: Sequence[Trial], stage: str | None
    ) -> dict[str, Any]:
        opts = self.opts
        if stage is None:  # simulate-only: the model's best
            winner = finalists[0] if finalists else default
        else:
            measured = [t for t in [default, *finalists] if t.goodput(stage) is not None]
            winner = (
                measured_winner(measured, stage, opts.slos, opts.attainment, self.log)
                if measured
                else default
            )
        self.write_trials()
        summary = self.write_summary()
        tuned_path = write_tuned(opts.name, winner.overrides, self._header(winner))
        (opts.out / "tuned.yaml").write_text(tuned_path.read_text())
        report = build_report(
            opts, self.workload, self.trials, default, winner, stage,
            tuned_path=tuned_path, summary=summary, measure_s=self.measure_s,
            model_s=self.model_s, wall_s=time.perf_counter() - self.started,
            engine_model=self.model.to_dict(),
        )  # fmt: skip
        (opts.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
        (opts.out / "report.md").write_text(report_markdown(report))
        return report

    def _header(self, winner: Trial) -> list[str]:
        return [
            f"inferflow tune: the best point for {workload_text(self.workload)} under "
            f"{slo_text(self.opts.slos)}",
            f"tuned on the base: {' '.join(self.opts.overrides) or '(the default config)'}",
            f"serve it: {serve_command(self.opts)}",
            f"reproduce: {reproduce_command(self.opts)}",
        ]

    def write_trials(self) -> Path:
        return write_trials_csv(self.trials, self.opts.out / "trials.csv")

    def write_summary(self) -> dict[str, Path | None] | None:
        return write_trials_summary(
            self.trials, self.opts.out, f"inferflow tune {self.opts.name}", self.log
        )


def _served_measure(
    overrides: Sequence[str],
    workload: Mapping[str, Any],
    goodput: Mapping[str, float],
    repeats: int,
    warmup: int,
    log_dir: Path,
    servers: int = 1,
    max_spread: float = 0.10,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    from inferflow.experiment.served import measure_served, tokenizer_of

    return measure_served(
        overrides,
        workload,
        goodput,
        repeats=repeats,
        warmup=warmup,
        max_spread=max_spread,
        log_dir=log_dir,
        timeout_s=timeout_s,
        tokenizer=tokenizer_of(overrides),
        servers=servers,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_args(list(sys.argv[1:] if argv is None else argv))
        tuner = Tuner(opts)
    except (ArgumentError, ConfigError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except (HydraException, OmegaConfBaseException) as exc:  # composing the base overrides
        from inferflow.cli import describe_hydra_error

        print(f"{PROG}: {describe_hydra_error(exc)}", file=sys.stderr)
        return 2
    if opts.list_space:
        print("\n".join(tuner.space.describe()))
        return 0
    try:
        import optuna  # noqa: F401
    except ModuleNotFoundError:
        print(f"{PROG}: needs optuna (pip install 'optuna>=4.5')", file=sys.stderr)
        return 1
    try:
        with signal_raises(signal.SIGTERM):  # a kill or a CI timeout stops it as Ctrl+C does
            report = tuner.run()
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # (a server being measured was stopped by measure_served)
        if tuner.trials:
            tuner.write_trials()
        sig = signal_of(exc)
        print(
            f"{PROG}: interrupted ({signal.Signals(sig).name}); trials so far in "
            f"{opts.out / 'trials.csv'}",
            file=sys.stderr,
        )
        return 128 + sig
    print_report(report)
    measured = report["stage"] == "simulated" or report["winner"].get("request_goodput") is not None
    return 0 if measured else 1
