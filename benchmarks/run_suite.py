#!/usr/bin/env python
"""Benchmark suite: inferflow under several configurations, or any OpenAI-compatible server.

    python benchmarks/run_suite.py                          # every named config, c = 1, 8, 32
    python benchmarks/run_suite.py --configs batching-none,batching-continuous --concurrency 1,8,32
    python benchmarks/run_suite.py --sweep batching=none,continuous cache=prefix,none
    python benchmarks/run_suite.py --url http://127.0.0.1:8001 --label vllm    # a peer server
    python benchmarks/run_suite.py --summary-only           # rebuild summary.md from the files

For each configuration the suite starts ``python -m inferflow server.port=N <overrides>`` as a
subprocess (its own process group, log in ``<results>/logs/<name>.log``), waits for
``GET /ready``, runs the load generator (``inferflow.bench``, the same client for every server)
once per concurrency level, stops the server, and writes ``<results>/<name>-c<N>.json`` (vLLM
result layout plus ``label``, ``suite_config``, ``overrides``). ``<results>/summary.md`` tabulates
every result file in the folder. A configuration whose server does not become ready is reported
in the summary with the error lines of its log, and the suite goes on. The reusable pieces
(managed server, points, summary) live in ``inferflow.bench.suite``.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from inferflow.bench.suite import (  # noqa: E402
    ServerStartError,
    free_port,
    managed_server,
    run_points,
    write_summary,
)

# Every named config is BASE with one axis changed, so each comparison varies one thing.
BASE = {"batching": "continuous", "cache": "prefix", "tracing": "off", "executor.precision": "fp32"}
CONFIGS: dict[str, dict[str, str]] = {
    "batching-none": {"batching": "none"},
    "batching-static": {"batching": "static"},
    "batching-dynamic": {"batching": "dynamic"},
    "batching-continuous": {},
    "prefix-cache-on": {},
    "prefix-cache-off": {"cache": "none"},
    "tracing-off": {},
    "tracing-file": {"tracing": "file"},
    "tracing-otlp": {"tracing": "otlp"},
    "precision-fp32": {},
    "precision-int8": {"executor.precision": "int8"},
    "precision-int4": {"executor.precision": "int4"},
}
DEFAULT_SERVER_CMD = "{python} -m inferflow server.port={port} {overrides}"


@dataclass(frozen=True)
class SuiteConfig:
    name: str
    overrides: tuple[str, ...]


def named_configs(names: list[str] | None) -> list[SuiteConfig]:
    chosen = names or list(CONFIGS)
    unknown = [n for n in chosen if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config(s) {unknown}; known: {', '.join(CONFIGS)}")
    return [
        SuiteConfig(n, tuple(f"{k}={v}" for k, v in {**BASE, **CONFIGS[n]}.items())) for n in chosen
    ]


def sweep_configs(params: list[str]) -> list[SuiteConfig]:
    """Cartesian product of ``KEY=V1,V2`` (Hydra basic-sweeper syntax) on top of BASE."""
    axes = []
    for param in params:
        key, sep, values = param.partition("=")
        if not sep or not values:
            raise SystemExit(f"--sweep expects KEY=V1,V2,..., got {param!r}")
        axes.append([(key, v) for v in values.split(",")])
    out = []
    for combo in itertools.product(*axes):
        chosen = dict(combo)
        name = ",".join(f"{k}={v}" for k, v in combo).replace("/", "_")
        out.append(SuiteConfig(name, tuple(f"{k}={v}" for k, v in {**BASE, **chosen}.items())))
    return out


def server_command(template: str, port: int, overrides: tuple[str, ...]) -> list[str]:
    """Expand ``{python}``, ``{port}`` and the ``{overrides}`` token of a command template."""
    cmd: list[str] = []
    for token in shlex.split(template):
        if token == "{overrides}":
            cmd.extend(overrides)
        else:
            cmd.append(token.replace("{python}", sys.executable).replace("{port}", str(port)))
    return cmd


def workload_argv(args: argparse.Namespace) -> list[str]:
    """Generator arguments shared by every (server, concurrency) point."""
    argv = [
        "--endpoint", args.endpoint, "--dataset-name", args.dataset_name,
        "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
        "--range-ratio", str(args.range_ratio), "--request-rate", str(args.request_rate),
        "--seed", str(args.seed), "--num-warmups", str(args.num_warmups),
    ]  # fmt: skip
    optional = (
        ("--input-len", args.input_len),
        ("--model", args.model),
        ("--tokenizer", args.tokenizer),
        ("--dataset-path", args.dataset_path),
    )
    for flag, value in optional:
        if value is not None:
            argv += [flag, str(value)]
    if args.goodput:
        argv += ["--goodput", *args.goodput]
    return argv + list(args.bench_arg or [])


def run_inferflow(
    args: argparse.Namespace, configs: list[SuiteConfig], results: Path
) -> dict[str, str]:
    """Each config: start the server, measure every concurrency level, stop it."""
    failures: dict[str, str] = {}
    for config in configs:
        port = free_port()
        cmd = server_command(args.server_cmd, port, config.overrides)
        print(f"== {config.name}: {shlex.join(cmd)}", flush=True)
        log = results / "logs" / f"{config.name}.log"
        try:
            with managed_server(cmd, port, log, args.startup_timeout, cwd=REPO) as url:
                notes = run_points(
                    url, config.name, args.concurrency, workload_argv(args), results,
                    config.overrides,
                )  # fmt: skip
        except ServerStartError as exc:
            notes = [str(exc)]
        if notes:
            failures[config.name] = "\n".join(notes)
    return failures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", help=f"comma-separated names (default: all): {', '.join(CONFIGS)}")
    p.add_argument("--sweep", nargs="+", metavar="KEY=V1,V2", help="cartesian product instead")
    p.add_argument("--url", help="benchmark this OpenAI-compatible server instead of starting one")
    p.add_argument("--label", default="peer", help="name of the --url server in the results")
    p.add_argument(
        "--server-cmd",
        default=DEFAULT_SERVER_CMD,
        help="command template; {python}, {port} and {overrides} are expanded",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--summary-only", action="store_true")
    p.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32]
    )
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--dataset-name", default="random")
    p.add_argument("--dataset-path")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--request-rate", default="inf")
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model")
    p.add_argument("--tokenizer")
    p.add_argument("--goodput", nargs="+")
    p.add_argument("--bench-arg", action="append", help="extra generator argument (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Exit code 0 when every configuration produced all its points, 1 otherwise."""
    args = parse_args(argv)
    results: Path = args.results_dir
    results.mkdir(parents=True, exist_ok=True)
    failures: dict[str, str] = {}
    if args.url:
        url = args.url.rstrip("/")
        notes = run_points(url, args.label, args.concurrency, workload_argv(args), results)
        failures = {args.label: "\n".join(notes)} if notes else {}
    elif not args.summary_only:
        configs = (
            sweep_configs(args.sweep)
            if args.sweep
            else named_configs(args.configs.split(",") if args.configs else None)
        )
        failures = run_inferflow(args, configs, results)
    summary = write_summary(results, failures)
    print(summary.read_text())
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
