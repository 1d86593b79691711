"""Building blocks of benchmark suites: a managed server process, one generator run per
concurrency level, and the markdown summary of a results folder.

``benchmarks/run_suite.py`` is the command-line suite; a Hydra task (``-m +experiment=...``) can
drive the same pieces: start a server with :func:`managed_server`, measure it with
:func:`run_points`, tabulate with :func:`write_summary`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from inferflow.bench.cli import main as bench_main


class ServerStartError(RuntimeError):
    """The server exited or did not answer ``/ready`` in time; the message quotes its log."""


def free_port() -> int:
    """A port free right now on 127.0.0.1 (another process may still take it before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_pid(port: int) -> int:
    """The pid of the ``python -m inferflow ... server.port=<port>`` process (Linux /proc)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "-m inferflow" in cmd and f"server.port={port}" in cmd:
                return int(proc.name)
    raise RuntimeError(f"no server on port {port}")


def log_excerpt(path: Path, lines: int = 20) -> str:
    """The log's first few error lines (the cause) and its last ``lines`` lines (the outcome)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    causes = [line for line in text[:-lines] if "Error" in line or "ERROR" in line][:5]
    head = [*causes, "..."] if causes else []
    return "\n".join(head + text[-lines:])


def wait_ready(
    proc: subprocess.Popen[bytes],
    url: str,
    timeout: float,
    log: Path,
    ready_path: str = "/ready",
    settled: bool = True,
) -> None:
    """Poll ``GET {url}{ready_path}`` until it answers 200; fail early when the process exits.

    An inferflow server (``/ready``) is then also given the time to finish its start-up work
    (its KV memory is made resident in the background, ``engine.executor.kv_resident`` in
    ``/admin/stats``), as the peers clear their KV before they answer: a benchmark's first
    requests do not share the CPU with page zeroing. ``settled=False`` returns at the first
    200, as a load balancer would send traffic (``task=bench`` measures the server so)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            ready = httpx.get(f"{url}{ready_path}", timeout=5.0).status_code == 200
            if ready and (not settled or ready_path != "/ready" or kv_resident(url)):
                return
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = proc.wait(timeout=0.5)  # doubles as the poll interval
            raise ServerStartError(f"server exited with code {code}:\n{log_excerpt(log)}")
    raise ServerStartError(f"server not ready after {timeout:.0f} s:\n{log_excerpt(log)}")


def kv_resident(url: str, api_key: str | None = None) -> bool:
    """False while an inferflow server still makes its KV resident (True when it does not say:
    no LLM, another host, ``/admin/stats`` refused)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stats = httpx.get(f"{url}/admin/stats", headers=headers, timeout=5.0)
    if stats.status_code != 200:
        return True
    executor = (stats.json().get("engine") or {}).get("executor") or {}
    return bool(executor.get("kv_resident", 1))


def stop_process_group(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM the server's own process group (started with a new session), then SIGKILL.

    A second Ctrl+C while it drains kills the group at once (it has its own session: nothing
    else would stop it) and is then raised."""
    if proc.poll() is not None:
        return
    try:
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
                return
    except KeyboardInterrupt:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise


@contextlib.contextmanager
def managed_server(
    cmd: Sequence[str],
    port: int,
    log: Path,
    timeout: float,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    ready_path: str = "/ready",
    settled: bool = True,
) -> Iterator[str]:
    """Start ``cmd`` (serving on ``port``), yield its base URL once ready, always stop it.

    The process gets its own session, so stopping it also stops its workers; its output goes to
    ``log``. ``env`` adds to the environment; ``ready_path`` is where a peer server says it is
    ready (llama-server and vLLM: ``/health``); ``settled``: see :func:`wait_ready`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, timeout, log, ready_path, settled)
        yield url
    finally:
        stop_process_group(proc)


def run_points(
    url: str,
    label: str,
    concurrency_levels: Sequence[int],
    workload: Sequence[str],
    results: Path,
    overrides: Sequence[str] = (),
    suffix: str = "",
) -> list[str]:
    """One generator run per concurrency level, each saved as ``{results}/{label}-c{N}{suffix}.json``.

    ``workload`` is generator arguments shared by every point (dataset, lengths, rate, ...).
    Returns failure notes, empty when every point completed requests."""
    notes = []
    for concurrency in concurrency_levels:
        print(f"== {label}: concurrency {concurrency}", flush=True)
        argv = [
            "--base-url", url, "--max-concurrency", str(concurrency), "--label", label,
            "--save-result", "--result-dir", str(results),
            "--result-filename", f"{label}-c{concurrency}{suffix}.json",
            "--request-id-prefix", f"{label}-c{concurrency}{suffix}-", "--disable-tqdm",
            *workload,
            "--metadata", f"suite_config={label}", f"overrides={' '.join(overrides)}",
        ]  # fmt: skip
        code = bench_main(argv)
        if code != 0:
            notes.append(f"concurrency {concurrency}: generator exit code {code}")
    return notes


def write_report(path: Path, text: str, notes: Sequence[str]) -> str:
    """Write a benchmark's markdown (``text`` and, if any, its notes as a list) to ``path`` and
    print it; returns what was written."""
    if notes:
        text += "\nNotes:\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    path.write_text(text)
    print(text)
    return text


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


def load_results(results: Path) -> list[dict[str, Any]]:
    """Every generator result file (a JSON object with serving metrics) in ``results``."""
    rows = []
    for path in sorted(results.glob("*.json")):
        with contextlib.suppress(json.JSONDecodeError, OSError, UnicodeDecodeError):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and {"request_throughput", "completed"} <= data.keys():
                rows.append(data)
    return rows


def _cell(row: Mapping[str, object], key: str, fmt: str) -> str:
    value = row.get(key)
    return "n/a" if value is None else fmt.format(value)


def write_summary(results: Path, failures: dict[str, str]) -> Path:
    """``summary.md``: one row per result file (latencies in ms), by label then concurrency,
    then the failures (name → note) of the current run."""
    rows = sorted(
        load_results(results), key=lambda r: (str(r.get("label")), r.get("max_concurrency") or 0)
    )
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
            f"Workload: dataset `{first.get('dataset_name')}`, {first.get('num_prompts')} "
            f"prompts per point, request rate {first.get('request_rate')}, "
            f"model `{first.get('model_id')}`.",
        ]
    if failures:
        lines += ["", "## Failures", ""]
        for name, text in failures.items():
            lines += [f"### {name}", "", "```", text, "```", ""]
    path = results / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
