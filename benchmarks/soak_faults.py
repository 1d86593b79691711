#!/usr/bin/env python
"""Soak and fault injection: mixed streaming load while the server's processes are hurt.

    python benchmarks/soak_faults.py                       # ~2.5 minutes on the embedded model
    python benchmarks/soak_faults.py --duration 600 --concurrency 32 -- +model=local model.path=DIR

Starts ``python -m inferflow`` (continuous batching, a short watchdog so a long stop is caught
within the run) and drives it with ``--concurrency`` clients for ``--duration`` seconds: half
completions, half chat; 60 % streamed; random prompts and ``max_tokens``; 10 % of streams hang up
after a few chunks and 5 % of the other requests give up after a few milliseconds (deliberate
disconnects and deadlines). Meanwhile, at fixed fractions of the run:

    25 %  SIGKILL the engine worker              (in-flight requests: worker_crashed; restart)
    45 %  SIGSTOP the worker for 3 s, then SIGCONT (streams pause and resume)
    65 %  SIGSTOP the worker past the watchdog    (readiness 503, watchdog kill, restart)

After the load it waits for the server to go idle and records the engine's state and the CPU
the idle server uses. Last, with a few streams running, it SIGKILLs the queue (Manager) process:
every stream must end with an explicit ``queue_lost`` error and the server must exit with code 1,
with no traceback (an orchestrator restarts it from there).

Every request is classified: ``ok`` (a complete answer), ``explicit`` (an HTTP error with OpenAI's
error body, or an SSE error event followed by ``[DONE]``), ``abandoned`` (our own disconnects and
deadlines), ``refused`` (a connection refused after the server exited: never accepted) or
``lost`` (accepted, then cut or left unanswered), plus ``anomaly`` (an answer that breaks the
API's promises, e.g. more tokens than ``max_tokens``). The bar: no lost, no anomaly.
Writes ``benchmarks/results/soak_faults.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from inferflow.bench.suite import free_port, stop_process_group, wait_ready  # noqa: E402
from inferflow.server.process_utils import descendants  # noqa: E402

WORDS = [
    "the",
    "a",
    "of",
    "model",
    "token",
    "stream",
    "batch",
    "cache",
    "engine",
    "queue",
    "server",
    "request",
    "river",
    "light",
]
WATCHDOG_S, STALL_S = 6.0, 3.0  # short limits, so a long stop is caught within the run
LONG_STOP_S = WATCHDOG_S + 4.0
CLIENT_TIMEOUT_S = 120.0  # a request unanswered this long is lost


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # explicit error codes
    lost_examples: list[str] = field(default_factory=list)
    sent: int = 0

    def add(self, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        if outcome == "explicit":
            self.errors[detail] += 1
        if outcome in ("lost", "anomaly") and len(self.lost_examples) < 10:
            self.lost_examples.append(detail)


def _process(pid: int, name: str) -> int | None:
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/comm").read_text().strip() == name:
                return child
    return None


def _cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _body(rng: random.Random, model: str, route: str, stream: bool) -> dict:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    body: dict = {"model": model, "max_tokens": rng.randint(1, 128)}
    body["temperature"] = rng.choice([0.0, 0.7, 1.0])
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(WORDS)]
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def _one(
    client: httpx.AsyncClient, url: str, model: str, rng: random.Random, t: Tally
) -> float:
    """One request, classified; returns how long to wait before the next (Retry-After)."""
    route = rng.choice(["completions", "chat"])
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    stream = rng.random() < 0.6
    body = _body(rng, model, route, stream)
    t.sent += 1
    try:
        if stream:
            hang_up_after = rng.randint(1, 5) if rng.random() < 0.1 else None
            return await _stream(client, url + path, body, hang_up_after, t)
        else:
            deadline = rng.uniform(0.01, 0.08) if rng.random() < 0.05 else CLIENT_TIMEOUT_S
            try:
                response = await client.post(url + path, json=body, timeout=deadline)
            except httpx.TimeoutException:
                t.add("abandoned" if deadline < CLIENT_TIMEOUT_S else "lost", "client timeout")
                return 0.0
            _classify_json(response, body, t)
            return _retry_after(response)
    except httpx.ConnectError:
        t.add("refused")
        return 0.5
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        t.add("lost", f"{path}: connection cut: {exc!r}"[:200])
    return 0.0


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(1.0, float(response.headers.get("retry-after", 0)))
    except ValueError:
        return 0.0


def _classify_json(response: httpx.Response, body: dict, t: Tally) -> None:
    if response.status_code == 200:
        usage = response.json().get("usage") or {}
        if usage.get("completion_tokens", 0) > body["max_tokens"]:
            t.add("anomaly", "more tokens than max_tokens")
        else:
            t.add("ok")
        return
    try:
        code = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        t.add("lost", f"HTTP {response.status_code} without an error body")
        return
    t.add("explicit", f"{response.status_code} {code}")


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict, hang_up_after: int | None, t: Tally
) -> float:
    """One stream, classified; returns the server's Retry-After if it refused it (else 0)."""
    async with client.stream("POST", url, json=body, timeout=CLIENT_TIMEOUT_S) as response:
        if response.status_code != 200:
            await response.aread()
            _classify_json(response, body, t)
            return _retry_after(response)
        chunks, error, done = 0, None, False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                error = event["error"].get("code")
                continue
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                t.add("abandoned", "hung up")
                return 0.0
    if done and error:
        t.add("explicit", f"stream {error}")
    elif done:
        t.add("ok")
    else:
        t.add("lost", f"stream ended without [DONE] after {chunks} chunks")
    return 0.0


async def _load(url: str, model: str, concurrency: int, until: float, t: Tally, seed: int) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < until:
                wait = await _one(client, url, model, rng, t)
                if wait:
                    await asyncio.sleep(wait)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))


async def _faults(pid: int, url: str, start: float, duration: float, log: list[str]) -> None:
    def at(fraction: float) -> float:
        return start + fraction * duration

    async def sleep_until(moment: float) -> None:
        await asyncio.sleep(max(0.0, moment - time.monotonic()))

    def worker() -> int:
        found = _process(pid, "inferflow-llm")
        if found is None:
            raise RuntimeError("no engine worker process (inferflow-llm) found")
        return found

    await sleep_until(at(0.25))
    victim = worker()
    os.kill(victim, signal.SIGKILL)
    log.append(f"{time.monotonic() - start:6.1f} s  SIGKILL engine worker {victim}")
    await _wait_ready(url, log, start)

    await sleep_until(at(0.45))
    victim = worker()
    os.kill(victim, signal.SIGSTOP)
    log.append(f"{time.monotonic() - start:6.1f} s  SIGSTOP engine worker {victim} for 3 s")
    await asyncio.sleep(3.0)
    os.kill(victim, signal.SIGCONT)
    log.append(f"{time.monotonic() - start:6.1f} s  SIGCONT engine worker {victim}")

    await sleep_until(at(0.65))
    victim = worker()
    os.kill(victim, signal.SIGSTOP)
    log.append(
        f"{time.monotonic() - start:6.1f} s  SIGSTOP engine worker {victim} for {LONG_STOP_S} s "
        f"(watchdog {WATCHDOG_S} s)"
    )
    ready_503 = False
    stop_end = time.monotonic() + LONG_STOP_S
    async with httpx.AsyncClient() as client:
        while time.monotonic() < stop_end:
            with contextlib.suppress(httpx.HTTPError):
                ready_503 |= (await client.get(url + "/ready", timeout=2)).status_code == 503
            await asyncio.sleep(0.5)
    try:
        os.kill(victim, signal.SIGCONT)
        log.append(f"{time.monotonic() - start:6.1f} s  SIGCONT (the watchdog had not acted)")
    except ProcessLookupError:
        log.append(f"{time.monotonic() - start:6.1f} s  the watchdog had killed the worker")
    log.append(f"{time.monotonic() - start:6.1f} s  /ready turned 503 during the stop: {ready_503}")
    await _wait_ready(url, log, start)


async def _wait_ready(url: str, log: list[str], start: float) -> None:
    began = time.monotonic()
    async with httpx.AsyncClient() as client:
        await asyncio.sleep(0.3)
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url + "/ready", timeout=2)).status_code == 200:
                    break
            await asyncio.sleep(0.1)
    log.append(
        f"{time.monotonic() - start:6.1f} s  ready again after {time.monotonic() - began:.1f} s"
    )


def _idle_state(url: str, pid: int) -> dict:
    deadline = time.monotonic() + 60
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/admin/stats", timeout=5).json()
        engine = stats.get("engine", {})
        if (
            not engine.get("running")
            and not engine.get("waiting")
            and not stats.get("in_flight")
            and engine.get("kv_blocks_free") == engine.get("kv_blocks_total")
        ):
            break
        time.sleep(0.5)
    tree = [pid, *descendants(pid)]
    before = _cpu_seconds(tree)
    time.sleep(5.0)
    cpu = (_cpu_seconds(tree) - before) / 5.0 * 100
    engine = stats.get("engine", {})
    return {
        "running": engine.get("running"),
        "waiting": engine.get("waiting"),
        "in_flight": stats.get("in_flight"),
        "kv_blocks_free": engine.get("kv_blocks_free"),
        "kv_blocks_total": engine.get("kv_blocks_total"),
        "idle_cpu_percent": round(cpu, 2),
    }


async def _queue_kill(url: str, model: str, pid: int, proc: subprocess.Popen, t: Tally) -> dict:
    rng = random.Random(7)
    async with httpx.AsyncClient() as client:
        bodies = [
            {**_body(rng, model, "completions", True), "max_tokens": 1500, "ignore_eos": True}
            for _ in range(4)
        ]
        tasks = [
            asyncio.create_task(_stream(client, url + "/v1/completions", b, None, t))
            for b in bodies
        ]
        t.sent += len(tasks)
        await asyncio.sleep(1.5)
        queue = _process(pid, "inferflow-queue")
        if queue is None:
            raise RuntimeError("no queue process (inferflow-queue) found")
        os.kill(queue, signal.SIGKILL)
        killed = time.monotonic()
        for task in tasks:
            try:
                await task
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                t.add("lost", f"queue kill: stream cut: {exc!r}"[:200])
        streams_ended_s = time.monotonic() - killed
    code = await asyncio.to_thread(proc.wait, 60)
    return {"streams_ended_after_s": round(streams_ended_s, 2), "server_exit_code": code}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks/results")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for the server")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args.results.mkdir(parents=True, exist_ok=True)
    log_path = args.results / "logs/soak_faults.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "inferflow",
        f"server.port={port}",
        "batching=continuous",
        "tracing=off",
        f"server.worker_stall_timeout_s={STALL_S}",
        f"server.worker_watchdog_s={WATCHDOG_S}",
        *args.overrides,
    ]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    events: list[str] = []
    tally = Tally()
    try:
        wait_ready(proc, url, 600, log_path)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        start = time.monotonic()

        async def run() -> None:
            await asyncio.gather(
                _load(url, model, args.concurrency, start + args.duration, tally, args.seed),
                _faults(proc.pid, url, start, args.duration, events),
            )

        asyncio.run(run())
        load_s = time.monotonic() - start
        idle = _idle_state(url, proc.pid)
        queue_kill = asyncio.run(_queue_kill(url, model, proc.pid, proc, tally))
    finally:
        stop_process_group(proc)
    log_text = log_path.read_text(errors="replace")
    result = {
        "command": " ".join(cmd),
        "duration_s": round(load_s, 1),
        "concurrency": args.concurrency,
        "sent": tally.sent,
        "outcomes": dict(tally.outcomes),
        "explicit_errors": dict(tally.errors),
        "lost": tally.outcomes["lost"],
        "lost_examples": tally.lost_examples,
        "faults": events,
        "idle_after_load": idle,
        "queue_kill": {
            **queue_kill,
            "queue_lost_log_line": "the queue process" in log_text,
            "traceback_in_log": "Traceback" in log_text,
        },
    }
    out_file = args.results / "soak_faults.json"
    out_file.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(events))
    accounted = sum(tally.outcomes.values())
    print(
        f"\nsent {tally.sent}  accounted {accounted}  "
        + "  ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items()))
    )
    print("explicit errors: " + ", ".join(f"{k} x{v}" for k, v in tally.errors.most_common()))
    print(f"idle after load: {idle}")
    print(f"queue-process kill: {result['queue_kill']}")
    print(f"LOST: {tally.outcomes['lost']}  ->  {out_file}")
    bad = tally.outcomes["lost"] or tally.outcomes["anomaly"] or accounted != tally.sent
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
