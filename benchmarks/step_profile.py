#!/usr/bin/env python
"""Where the wall time of a serving step goes, under load: a sampling profile of every process.

    python benchmarks/step_profile.py                              # the ~100M model, c32, defaults
    python benchmarks/step_profile.py --model 4m5 --concurrency 32 -- batching.max_num_seqs=16

Starts ``python -m inferflow +model=local model.path=<seeded checkpoint> [overrides]``, drives it
with ``inferflow bench`` (random prompts, ``ignore_eos``) and, once the load is steady, samples
every process of the server with py-spy (``--subprocesses --threads``, no GIL filter) for
``--duration`` seconds. Each sample of the engine thread is put in one category by its innermost
recognised frame (ONNX Runtime's run, the step's numpy inputs, sampler, scheduler, detokenizer,
engine deltas, telemetry, worker loop); the engine steps in the window come from the server's
``vllm:iteration_tokens_total`` counter, so each category is also given in ms per step. The other
processes (API, LitServe's queue Manager) and the worker's sender/intake threads are given as the
share of one core they kept busy. Writes ``benchmarks/results/step_profile-<model>-c<N>.json``
and prints a markdown table (the source of docs/performance.md's breakdown).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.peers import MODELS, add_path_args, checkpoint  # noqa: E402
from inferflow.bench.cli import main as bench_main  # noqa: E402
from inferflow.bench.suite import free_port, managed_server  # noqa: E402

# (category, substring of a frame "func (file:line)"), checked from the innermost frame outwards:
# the first frame that matches any rule names the sample's category.
ENGINE_RULES: list[tuple[str, str]] = [
    ("model forward: ONNX Runtime run", "onnxruntime/capi/"),
    ("model forward: torch", "torch/"),
    ("model forward: step inputs (numpy)", "runtimes/step_inputs.py"),
    ("model forward: runner Python", "runtimes/onnxruntime_runner.py"),
    ("model forward: runner Python", "runtimes/torch_engine/"),
    ("sampler", "sampling/sampler.py"),
    ("guided decoding", "sampling/bitmask.py"),  # the token mask (was guided/bitmask.py)
    ("guided decoding", "stages/guided.py"),
    ("detokenizer", "stages/detokenizer.py"),
    ("scheduler", "scheduling/"),
    ("telemetry", "telemetry/"),
    ("engine deltas (RequestOutput)", "engine/llm_engine.py"),
    ("engine step glue", "engine/step.py"),
    ("executor stage / plan runner", "stages/executor.py"),
    ("executor stage / plan runner", "runtimes/plan_runner.py"),
    ("worker loop: inbox wait / messages", "server/worker/queues.py"),
    ("worker loop: updates, bookkeeping", "server/worker/"),
]
PROCESS_ROLES = {"inferflow-llm": "engine worker", "inferflow-queue": "queue (LitServe Manager)"}


def role_of(comm: str) -> str:
    if comm.startswith("inferflow-api"):
        return "API process (uvicorn, SSE)"
    return PROCESS_ROLES.get(comm, "main (supervisor)")


def process_roles(root_pid: int) -> dict[int, str]:
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(root_pid)],
                         capture_output=True, text=True).stdout
    roles = {root_pid: "main (supervisor)"}
    for line in out.splitlines():
        pid, comm = line.split(None, 1)
        roles[int(pid)] = role_of(comm.strip())
    return roles


def steps_done(url: str) -> float:
    """The engine's step count so far (the iteration-tokens histogram's count)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in
               re.finditer(r"^vllm:iteration_tokens_total_count\{[^}]*\} (\S+)$", text, re.M))


def categorise(frames: list[str]) -> str:
    for frame in reversed(frames):
        for category, needle in ENGINE_RULES:
            if needle in frame:
                return category
    return "other Python"


def parse(raw: Path, roles: dict[int, str]) -> tuple[Counter[str], dict[str, Counter[str]]]:
    """py-spy raw lines -> samples of the engine thread by category, and of every other
    (process, thread) by name."""
    engine: Counter[str] = Counter()
    others: dict[str, Counter[str]] = defaultdict(Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        parts = stack.split(";")
        pids = [int(m.group(1)) for p in parts if (m := re.match(r"process (\d+):", p))]
        thread = next((p for p in parts if p.startswith("thread (")), "thread (?)")
        frames = [p for p in parts if not p.startswith(("process ", "thread ("))]
        role = roles.get(pids[-1], "other") if pids else "other"
        if role == "engine worker" and any("EngineLoop.run" in f for f in frames):
            engine[categorise(frames)] += int(count)
        else:
            name = thread.split(": ", 1)[-1].split("|")[-1]
            others[role][re.sub(r"_\d+$", "", name)] += int(count)
    return engine, others


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="100m")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--warmup-s", type=float, default=15.0, help="load before sampling starts")
    p.add_argument("--duration", type=float, default=20.0, help="seconds sampled")
    p.add_argument("--rate", type=int, default=100, help="samples per second per thread")
    add_path_args(p, REPO / "benchmarks" / "results", peers=False)
    p.add_argument("overrides", nargs="*", help="Hydra overrides for the server (after --)")
    args = p.parse_args()
    path = checkpoint(args.model, args.models_dir)
    port = free_port()
    cmd = [sys.executable, "-m", "inferflow", "+model=local", f"model.path={path}",
           f"server.port={port}", *args.overrides]
    log = args.results_dir / "logs" / f"step_profile-{args.model}.log"
    raw = Path(tempfile.mkdtemp()) / "pyspy.txt"
    with managed_server(cmd, port, log, timeout=900) as url:
        root_pid = int(subprocess.run(["pgrep", "-f", f"server.port={port}"], capture_output=True,
                                      text=True).stdout.split()[0])
        roles = process_roles(root_pid)
        load = threading.Thread(target=bench_main, args=([
            "--base-url", url, "--model", path.name, "--dataset-name", "random",
            "--tokenizer", str(path / "tokenizer.json"), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency), "--ignore-eos", "--disable-tqdm"],),
            daemon=True)
        load.start()
        time.sleep(args.warmup_s)
        before = steps_done(url)
        subprocess.run(["py-spy", "record", "--pid", str(root_pid), "--subprocesses",
                        "--threads", "--nonblocking", "--format", "raw", "--rate",
                        str(args.rate), "--duration", str(int(args.duration)), "-o", str(raw)],
                       check=True, capture_output=True)
        steps = steps_done(url) - before
        still_loaded = load.is_alive()
        load.join()
    engine, others = parse(raw, roles)
    wall = args.rate * args.duration  # samples of a thread busy for the whole window
    idle = max(0.0, wall - sum(engine.values()))
    per_step = 1000.0 * args.duration / steps if steps else float("nan")
    rows = [{"category": c, "share": n / wall, "ms_per_step": per_step * n / wall}
            for c, n in engine.most_common()]
    rows.append({"category": "engine thread not running (off-CPU: other threads, GIL)",
                 "share": idle / wall, "ms_per_step": per_step * idle / wall})
    busy = {role: {t: n / wall for t, n in threads.most_common(6)}
            for role, threads in others.items()}
    result = {"model": args.model, "concurrency": args.concurrency, "overrides": args.overrides,
              "duration_s": args.duration, "steps": steps, "ms_per_step": per_step,
              "load_covered_window": still_loaded, "engine_thread": rows,
              "other_threads_core_share": busy}
    out = args.results_dir / f"step_profile-{args.model}-c{args.concurrency}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{steps:.0f} steps in {args.duration:.0f} s: {per_step:.1f} ms per step "
          f"({args.model}, c{args.concurrency}, {' '.join(args.overrides) or 'defaults'})")
    if not still_loaded:
        print("WARNING: the load ended inside the window; raise --num-prompts")
    print("\n| engine thread | share of wall | ms per step |\n|---|---|---|")
    for r in rows:
        print(f"| {r['category']} | {100 * r['share']:.1f}% | {r['ms_per_step']:.2f} |")
    print("\n| process | thread | share of one core |\n|---|---|---|")
    for role, threads in busy.items():
        for t, share in threads.items():
            print(f"| {role} | {t} | {100 * share:.1f}% |")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
