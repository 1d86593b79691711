"""What the model repository costs: a cold on-demand load, a swap under a memory budget, and
an idle server with several engine workers.

    python benchmarks/model_repository.py                  # two seeded tiny checkpoints
    python benchmarks/model_repository.py --model-a DIR --model-b DIR --rounds 6

One server (``python -m inferflow``) with ``a`` and ``b``, both ``load: on_demand``, under a
``server.model_memory_budget`` that fits one of them (1.5 x the footprint the server reports for
one), driven by plain HTTP requests of ``--max-tokens`` greedy tokens:

- warm: a request to the model that is loaded (the baseline);
- cold: the first request to a model nothing is loaded for (spawn, engine load, warm-up);
- swap: a request to the other model (unload the idle one, wait for its exit, load this one);
- the workers' resident memory after each request, against the budget;
- idle: CPU seconds the whole process tree uses in ``--idle-s`` seconds with both models once
  loaded without a budget (a second server), and its resident memory per worker.

Writes ``benchmarks/results/model_repository/results.json`` and ``model_repository.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.bench.suite import free_port, managed_server, server_pid, write_report  # noqa: E402
from inferflow.server.process_utils import descendants, process_rss  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "model_repository"


def entries(a: Path, b: Path, load: str) -> list[str]:
    out = []
    for key, path in (("a", a), ("b", b)):
        out += [f"+models.{key}.model.path={path}", f"+models.{key}.model.name={key}",
                f"+models.{key}.load={load}"]
    return out


def server_cmd(port: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "inferflow", f"server.port={port}", "tracing=off", *overrides]


def complete(url: str, model: str, max_tokens: int) -> float:
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": model, "prompt": "The quick brown fox", "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True,
    })
    response.raise_for_status()
    return (time.perf_counter() - started) * 1000


def worker_rss(root_pid: int) -> list[int]:
    pids = [p for p in descendants(root_pid)
            if Path(f"/proc/{p}/comm").read_text().startswith("inferflow-llm")]
    return [process_rss(p) for p in pids]


def cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def measure(a: Path, b: Path, rounds: int, max_tokens: int, idle_s: float) -> dict:
    results: dict = {"rounds": rounds, "max_tokens": max_tokens}
    # 1. no budget, both loaded: the footprint of one worker, idle CPU and RSS
    port = free_port()
    with managed_server(server_cmd(port, entries(a, b, "on_demand")), port,
                        OUT / "logs" / "idle.log", 300) as url:
        complete(url, "a", max_tokens)
        complete(url, "b", max_tokens)
        models = httpx.get(f"{url}/ready").json()["models"]
        footprint = max(max(m["memory_bytes"], m["rss_bytes"] or 0) for m in models)
        pid = server_pid(port)
        tree = [pid, *descendants(pid)]
        time.sleep(2.0)
        before = cpu_seconds(tree)
        time.sleep(idle_s)
        results["idle"] = {
            "seconds": idle_s,
            "cpu_seconds": round(cpu_seconds(tree) - before, 3),
            "worker_rss_mb": [round(r / 2**20, 1) for r in worker_rss(pid)],
            "footprint_mb": round(footprint / 2**20, 1),
        }
    # 2. a budget that fits one: cold load, warm requests, swaps
    budget = int(1.5 * footprint)
    port = free_port()
    overrides = [*entries(a, b, "on_demand"), f"server.model_memory_budget={budget}"]
    with managed_server(server_cmd(port, overrides), port, OUT / "logs" / "budget.log", 300) as url:
        pid = server_pid(port)
        cold = complete(url, "a", max_tokens)
        warm = [complete(url, "a", max_tokens) for _ in range(rounds)]
        swaps, peak = [], sum(worker_rss(pid))
        for i in range(rounds):
            swaps.append(complete(url, "b" if i % 2 == 0 else "a", max_tokens))
            peak = max(peak, sum(worker_rss(pid)))
        results["budget"] = {
            "budget_mb": round(budget / 2**20, 1),
            "cold_ms": round(cold, 1),
            "warm_ms_median": round(statistics.median(warm), 1),
            "swap_ms_median": round(statistics.median(swaps), 1),
            "swap_ms_max": round(max(swaps), 1),
            "peak_workers_rss_mb": round(peak / 2**20, 1),
        }
    return results


def report(results: dict) -> str:
    idle, budget = results["idle"], results["budget"]
    text = (
        "| measure | value |\n|---|---|\n"
        f"| warm request ({results['max_tokens']} tokens), median | "
        f"{budget['warm_ms_median']} ms |\n"
        f"| cold on-demand load + request | {budget['cold_ms']} ms |\n"
        f"| swap (unload idle, load other) + request, median / max | "
        f"{budget['swap_ms_median']} / {budget['swap_ms_max']} ms |\n"
        f"| budget / peak RSS of the workers during swaps | {budget['budget_mb']} / "
        f"{budget['peak_workers_rss_mb']} MiB |\n"
        f"| footprint counted per worker | {idle['footprint_mb']} MiB |\n"
        f"| idle: CPU of the whole tree, 2 workers, {idle['seconds']} s | "
        f"{idle['cpu_seconds']} s |\n"
        f"| idle: RSS per worker | {', '.join(map(str, idle['worker_rss_mb']))} MiB |\n"
    )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-a", type=Path)
    parser.add_argument("--model-b", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=10.0)
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        a, b = args.model_a, args.model_b
        if a is None or b is None:
            from inferflow.models.tiny import make_checkpoint

            a, b = Path(tmp) / "tiny-a", Path(tmp) / "tiny-b"
            make_checkpoint(a, seed=1)
            make_checkpoint(b, seed=2)
        results = measure(a, b, args.rounds, args.max_tokens, args.idle_s)
    (OUT / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_report(OUT / "model_repository.md", "# Model repository\n\n" + report(results), [
        f"models: {args.model_a or 'tiny seeded checkpoints (seeds 1 and 2)'}"
        f"{'' if args.model_a is None else ', ' + str(args.model_b)}",
        "one machine, one run; cold and swap include spawning the worker, loading the cached "
        "engine and its warm-up request",
    ])


if __name__ == "__main__":
    main()
