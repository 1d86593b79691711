"""Ready means routable, and SIGTERM leaves nothing: N starts of the Ray host in a row.

    pip install -e ".[ray]"
    python benchmarks/ray_first_request.py                  # 20 starts, 2 engine replicas
    python benchmarks/ray_first_request.py --starts 3 -- server.num_replicas=1

Each start runs ``python -m inferflow server=ray server.num_replicas=2`` (a local Ray instance),
polls ``/ready`` every 50 ms and, the moment it first answers 200, sends one completion: its
status must not be a 5xx. Then SIGTERM goes to the server process (only to it: stopping what
it started is its job), and 30 s later none of the processes it had started may be alive (its
process tree as it stood at the signal); its exit code must be 0.

Writes ``benchmarks/results/ray_first_request.json`` (one record per start) and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.bench.suite import free_port  # noqa: E402
from inferflow.server.process_utils import descendants  # noqa: E402

READY_TIMEOUT_S = 600.0
EXIT_TIMEOUT_S = 120.0
LEFT_AFTER_S = 30.0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def one_start(index: int, overrides: list[str], logs: Path) -> dict:
    port = free_port()
    log = logs / f"start-{index:02d}.log"
    cmd = [
        sys.executable,
        "-m",
        "inferflow",
        "server=ray",
        f"server.port={port}",
        "tracing=off",
        *overrides,
    ]
    record: dict = {"start": index}
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                record["error"] = f"exited with {proc.returncode} before ready"
                return record
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - started > READY_TIMEOUT_S:
                record["error"] = "not ready in time"
                return record
            time.sleep(0.05)
        record["ready_s"] = round(time.monotonic() - started, 2)
        first = httpx.post(
            f"{url}/v1/completions",
            timeout=120,
            json={"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4},
        )
        record["first_status"] = first.status_code
        if first.status_code >= 500:
            record["first_body"] = first.text[:500]
        tree = [proc.pid, *descendants(proc.pid)]
        record["processes_at_sigterm"] = len(tree)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            record["exit_code"] = proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            record["exit_code"] = None
        record["exit_s"] = round(time.monotonic() - signalled, 2)
        while any(_alive(p) for p in tree) and time.monotonic() - signalled < LEFT_AFTER_S:
            time.sleep(0.2)
        record["left_30s_after_sigterm"] = [p for p in tree if _alive(p)]
        return record
    finally:
        if proc.poll() is None or any(_alive(p) for p in descendants(proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--starts", type=int, default=20)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument(
        "overrides",
        nargs="*",
        default=["server.num_replicas=2"],
        help="overrides of the Ray host (after --)",
    )
    args = p.parse_args()
    logs = args.results_dir / "logs" / "ray_first_request"
    logs.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(args.starts):
        record = one_start(i, args.overrides, logs)
        print(json.dumps(record), flush=True)
        records.append(record)
    ok = [
        r
        for r in records
        if r.get("first_status", 599) < 500
        and r.get("exit_code") == 0
        and not r.get("left_30s_after_sigterm")
        and "error" not in r
    ]
    (args.results_dir / "ray_first_request.json").write_text(json.dumps(records, indent=1))
    lines = [
        f"# Ray host: {args.starts} starts, first request after /ready, SIGTERM\n",
        f"overrides: `{' '.join(args.overrides)}`, {os.cpu_count()} cores\n",
        f"clean starts (first request < 500, exit 0, nothing left 30 s after SIGTERM): "
        f"**{len(ok)}/{len(records)}**\n",
        "| start | ready s | first status | exit code | exit s | left after 30 s |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['start']} | {r.get('ready_s', '—')} | {r.get('first_status', '—')} "
            f"| {r.get('exit_code', '—')} | {r.get('exit_s', '—')} | "
            f"{len(r.get('left_30s_after_sigterm', [])) if 'error' not in r else r['error']} |"
        )
    (args.results_dir / "ray_first_request.md").write_text("\n".join(lines) + "\n")
    return 0 if len(ok) == len(records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
