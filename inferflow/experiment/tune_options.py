"""``inferflow tune``'s command line: the options (:func:`build_parser`), checked into
:class:`Options` (:func:`parse_args`; :class:`ArgumentError` is one line naming the option).
What the options mean: :mod:`inferflow.experiment.tune`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferflow.config import ConfigError, ExperimentConfig

PROG = "inferflow tune"
SLO_NAMES = ("ttft", "tpot", "e2el")


class ArgumentError(ValueError):
    """A bad command line: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # (argparse would print usage and exit)
        raise ArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Search the composed config for the most goodput under "
        "SLOs (see inferflow/experiment/tune.py).",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the base config")
    p.add_argument(
        "--slo",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs in ms: ttft:2000 tpot:100 e2el:...",
    )
    p.add_argument(
        "--slo-attainment",
        type=float,
        default=None,
        metavar="P",
        help="constraint: at least this share of requests meets every SLO (0..1)",
    )
    p.add_argument("--request-rate", type=float, default=None, help="req/s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--burstiness", type=float, default=None)
    p.add_argument(
        "--space",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=RANGE",
        help="KEY=LOW:HIGH[:log], KEY=a,b,c or KEY",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=900.0,
        help="measurement time (engine profiles and served runs), seconds",
    )
    p.add_argument("--name", default="tuned", help="the override file: +tuned=NAME")
    p.add_argument("--out", default=None, help="output folder (default tune/NAME)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sim-trials", type=int, default=200, help="points ranked on the model")
    p.add_argument("--top", type=int, default=6, help="most candidates given a short run")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="repeats of a confirmation run (>= 2; 3 or more for a usable prediction interval)",
    )
    p.add_argument(
        "--max-profiles",
        type=int,
        default=3,
        help="distinct executor settings whose steps are timed",
    )
    p.add_argument(
        "--grid",
        action="store_true",
        help="measure every point of the space instead (the exhaustive baseline)",
    )
    p.add_argument(
        "--simulate-only", action="store_true", help="rank on the engine model, measure nothing"
    )
    p.add_argument("--list", action="store_true", help="print the search space and exit")
    return p


def parse_slos(items: Sequence[str]) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ArgumentError(
                f"--slo {item}: expected NAME:MS with NAME one of {', '.join(SLO_NAMES)}"
            )
        try:
            slos[name] = float(value)
        except ValueError:
            raise ArgumentError(f"--slo {item}: {value!r} is not a number of ms") from None
        if not slos[name] > 0:
            raise ArgumentError(f"--slo {item}: must be > 0 ms")
    return slos


@dataclass
class Options:
    """The parsed command line."""

    overrides: list[str]
    slos: dict[str, float]
    attainment: float | None
    workload: dict[str, Any]
    space_items: list[str]
    budget_s: float
    name: str
    out: Path
    seed: int
    sim_trials: int
    top: int
    repeats: int
    max_profiles: int
    grid: bool
    simulate_only: bool
    list_space: bool
    argv: list[str]


def parse_args(argv: Sequence[str]) -> Options:
    args = build_parser().parse_args(list(argv))
    slos = parse_slos(args.slo)
    if not slos and not args.list:
        raise ArgumentError("--slo: give at least one SLO, e.g. --slo ttft:2000 tpot:100")
    if args.slo_attainment is not None and not 0 < args.slo_attainment <= 1:
        raise ArgumentError("--slo-attainment: must be in (0, 1]")
    for name in (
        "max_concurrency",
        "input_len",
        "output_len",
        "num_prompts",
        "top",
        "repeats",
        "max_profiles",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ArgumentError("--request-rate: must be > 0 (or inf)")
    if args.budget_s <= 0 or args.sim_trials < 0:
        raise ArgumentError("--budget-s must be > 0 and --sim-trials >= 0")
    if not args.name.replace("-", "").replace("_", "").isalnum():
        raise ArgumentError(f"--name {args.name!r}: letters, digits, - and _ only")
    for o in args.overrides:
        if "=" not in o:
            raise ArgumentError(f"{o!r}: not an override (KEY=VALUE); options start with --")
    workload = {
        k: getattr(args, k)
        for k in (
            "request_rate",
            "max_concurrency",
            "input_len",
            "output_len",
            "num_prompts",
            "burstiness",
        )
        if getattr(args, k) is not None
    }
    if args.request_rate is not None and args.max_concurrency is None:
        workload["max_concurrency"] = None  # an open loop at that rate
    return Options(
        overrides=list(args.overrides),
        slos=slos,
        attainment=args.slo_attainment,
        workload=workload,
        space_items=list(args.space),
        budget_s=args.budget_s,
        name=args.name,
        out=Path(args.out or f"tune/{args.name}"),
        seed=args.seed,
        sim_trials=args.sim_trials,
        top=args.top,
        repeats=args.repeats,
        max_profiles=args.max_profiles,
        grid=args.grid,
        simulate_only=args.simulate_only,
        list_space=args.list,
        argv=list(argv),
    )


def refuse_what_options_set(exp: ExperimentConfig, opts: Options) -> None:
    """``experiment.repeats`` and ``experiment.goodput`` are tune's ``--repeats`` and ``--slo``:
    a base config that sets them otherwise is refused in one line, not silently overridden
    (``experiment.warmup``, ``servers``, ``max_spread``, ``server_timeout_s`` and ``workload``
    apply as in ``task=bench``; the ``--`` workload options override ``workload``)."""
    if exp.repeats not in (ExperimentConfig().repeats, opts.repeats):
        raise ConfigError(
            f"experiment.repeats={exp.repeats}: inferflow tune sets a confirmation's repeats "
            f"with --repeats (now {opts.repeats}); use --repeats {exp.repeats}"
        )
    if exp.goodput and dict(exp.goodput) != dict(opts.slos):
        given = " ".join(f"{k}:{v:g}" for k, v in exp.goodput.items())
        raise ConfigError(
            f"experiment.goodput: inferflow tune takes its SLOs from --slo, which differs; "
            f"use --slo {given} (or drop experiment.goodput)"
        )
