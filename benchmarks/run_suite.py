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
in the summary with the tail of its log and the suite goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from inferflow.bench.cli import main as bench_main  # noqa: E402

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


class ServerStartError(RuntimeError):
    """The server exited or did not answer ``/ready`` in time; the message ends with its log."""


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(template: str, port: int, overrides: tuple[str, ...]) -> list[str]:
    """Expand ``{python}``, ``{port}`` and the ``{overrides}`` token of a command template."""
    cmd: list[str] = []
    for token in shlex.split(template):
        if token == "{overrides}":
            cmd.extend(overrides)
        else:
            cmd.append(token.replace("{python}", sys.executable).replace("{port}", str(port)))
    return cmd


def log_tail(path: Path, lines: int = 20) -> str:
    """The log's first few error lines (the cause) and its last ``lines`` lines (the outcome)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    tail = text[-lines:]
    causes = [line for line in text[:-lines] if "Error" in line or "ERROR" in line][:5]
    return (
        "\n".join([*causes, "..."] if causes else []) + ("\n" if causes else "") + "\n".join(tail)
    )


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float, log: Path) -> None:
    """Poll ``GET {url}/ready`` until 200; fail early when the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/ready", timeout=5.0).status_code == 200:
                return
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = proc.wait(timeout=0.5)  # doubles as the poll interval
            raise ServerStartError(f"server exited with code {code}:\n{log_tail(log)}")
    raise ServerStartError(f"server not ready after {timeout:.0f} s:\n{log_tail(log)}")


def stop_process_group(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM the server's own process group (it was started with a new session), then KILL."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
            return


@contextlib.contextmanager
def managed_server(cmd: list[str], port: int, log: Path, timeout: float) -> Iterator[str]:
    """Start ``cmd``, yield its base URL once ready, always stop it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout, log)
        yield url
    finally:
        stop_process_group(proc)


def bench_argv(
    args: argparse.Namespace,
    url: str,
    label: str,
    concurrency: int,
    overrides: tuple[str, ...],
    results: Path,
) -> list[str]:
    """The generator's command line for one (server, concurrency) point."""
    argv = [
        "--base-url",
        url,
        "--endpoint",
        args.endpoint,
        "--dataset-name",
        args.dataset_name,
        "--num-prompts",
        str(args.num_prompts),
        "--output-len",
        str(args.output_len),
        "--range-ratio",
        str(args.range_ratio),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        str(args.request_rate),
        "--seed",
        str(args.seed),
        "--num-warmups",
        str(args.num_warmups),
        "--label",
        label,
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(results),
        "--result-filename",
        f"{label}-c{concurrency}.json",
        "--request-id-prefix",
        f"{label}-c{concurrency}-",
        "--metadata",
        f"suite_config={label}",
        f"overrides={' '.join(overrides)}",
    ]
    for flag, value in (
        ("--input-len", args.input_len),
        ("--model", args.model),
        ("--tokenizer", args.tokenizer),
        ("--dataset-path", args.dataset_path),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if args.goodput:
        argv += ["--goodput", *args.goodput]
    return argv + list(args.bench_arg or [])


def run_points(
    args: argparse.Namespace, url: str, label: str, overrides: tuple[str, ...], results: Path
) -> list[str]:
    """One generator run per concurrency level; returns failure notes (empty when all ran)."""
    notes = []
    for concurrency in args.concurrency:
        print(f"== {label}: concurrency {concurrency}", flush=True)
        code = bench_main(bench_argv(args, url, label, concurrency, overrides, results))
        if code != 0:
            notes.append(f"concurrency {concurrency}: generator exit code {code}")
    return notes


def run_inferflow(
    args: argparse.Namespace, configs: list[SuiteConfig], results: Path
) -> dict[str, str]:
    failures: dict[str, str] = {}
    for config in configs:
        port = free_port()
        cmd = server_command(args.server_cmd, port, config.overrides)
        print(f"== {config.name}: {shlex.join(cmd)}", flush=True)
        log = results / "logs" / f"{config.name}.log"
        try:
            with managed_server(cmd, port, log, args.startup_timeout) as url:
                notes = run_points(args, url, config.name, config.overrides, results)
        except ServerStartError as exc:
            notes = [str(exc)]
        if notes:
            failures[config.name] = "\n".join(notes)
    return failures


COLUMNS = [
    ("conc.", "max_concurrency", "{}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT mean", "mean_ttft_ms", "{:.1f}"),
    ("TTFT med", "median_ttft_ms", "{:.1f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.1f}"),
    ("TPOT med", "median_tpot_ms", "{:.1f}"),
    ("TPOT p99", "p99_tpot_ms", "{:.1f}"),
    ("ITL p99", "p99_itl_ms", "{:.1f}"),
    ("E2EL med", "median_e2el_ms", "{:.1f}"),
    ("E2EL p99", "p99_e2el_ms", "{:.1f}"),
    ("failed", "failed", "{}"),
]


def load_results(results: Path) -> list[dict]:
    rows = []
    for path in sorted(results.glob("*.json")):
        with contextlib.suppress(json.JSONDecodeError, OSError):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and "request_throughput" in data:
                rows.append(data)
    return rows


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "n/a" if value is None else fmt.format(value)


def write_summary(results: Path, failures: dict[str, str]) -> Path:
    """``summary.md``: one table row per result file (latencies in ms), grouped by label."""
    rows = load_results(results)
    rows.sort(key=lambda r: (str(r.get("label")), r.get("max_concurrency") or 0))
    lines = [
        "# Benchmark summary",
        "",
        "Metrics as in `vllm bench serve` (see docs/benchmarks.md); latencies in ms.",
        "",
        "| config | " + " | ".join(c[0] for c in COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for row in rows:
        cells = [_cell(row, key, fmt) for _, key, fmt in COLUMNS]
        lines.append(f"| {row.get('label')} | " + " | ".join(cells) + " |")
    if rows:
        first = rows[0]
        lines += [
            "",
            f"Workload: dataset `{first.get('dataset_name')}`, "
            f"{first.get('num_prompts')} prompts per point, "
            f"request rate {first.get('request_rate')}, model `{first.get('model_id')}`.",
        ]
    if failures:
        lines += ["", "## Failures", ""]
        for name, text in failures.items():
            lines += [f"### {name}", "", "```", text, "```", ""]
    path = results / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


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
        notes = run_points(args, args.url.rstrip("/"), args.label, (), results)
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
