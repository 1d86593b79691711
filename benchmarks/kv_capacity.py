#!/usr/bin/env python
"""KV bytes per running sequence and the most sequences running at once, at one KV budget, for
ONNX Runtime on its paged pool (``graph_form=paged``, the default where the op builds), the torch
executor (paged blocks) and ONNX Runtime on slots (``graph_form=gqa``).

    python benchmarks/kv_capacity.py                       # 32 MiB of KV, the tiny model
    python benchmarks/kv_capacity.py --budget 64MiB --requests 256

Each executor's engine is built from the same config a server composes (``executor=<name>
executor.kv_cache_memory=<budget> model.max_model_len=<len>``), then ``--requests`` requests of
``--prompt-len`` + ``--output-len`` tokens are added at once and stepped to the end (engine
steps, no HTTP, no timing). Per executor it records the reserved KV bytes, the sequences running
at the busiest step and at the median step while requests still wait (memory or slots decide,
not the number of requests), and the KV bytes per running sequence (reserved / that median). The slot executor is given the most slots for which the budget still serves
``--max-model-len`` (its slots are reserved at full length); the paged one ``max_num_seqs``
``--max-num-seqs`` and admits by free blocks. Writes ``benchmarks/results/kv_capacity.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.cli import compose_config  # noqa: E402
from inferflow.graph import ServingGraph, build_graph  # noqa: E402
from inferflow.sampling_params import SamplingParams  # noqa: E402
from inferflow.scheduling.kv_budget import kv_bytes_per_token, parse_memory  # noqa: E402


def graph(executor: str, budget: str, max_model_len: int, seqs: int) -> ServingGraph:
    """``executor``: ``torch``, ``paged`` (ONNX Runtime's paged form) or ``onnxruntime`` (slots)."""
    extra = ["executor.compile=eager"] if executor == "torch" else []  # capacity, not speed
    if executor in ("paged", "onnxruntime"):
        extra = [f"executor.graph_form={'paged' if executor == 'paged' else 'gqa'}"]
        executor = "onnxruntime"
    return build_graph(compose_config([
        f"executor={executor}", f"executor.kv_cache_memory={budget}",
        f"model.max_model_len={max_model_len}", f"batching.max_num_seqs={seqs}",
        "batching.max_num_batched_tokens=2048", "~cache", "tracing=off", *extra]))


def most_slots(budget: str, max_model_len: int) -> int:
    """The most ORT slots whose reservation still serves ``max_model_len`` (bisection: fewer
    slots always fit what more slots fit)."""

    def serves(slots: int) -> bool:
        try:
            return graph("onnxruntime", budget, max_model_len, slots).max_model_len >= max_model_len
        except Exception:  # the budget holds less than two blocks per slot
            return False

    low, high = 0, 4096  # serves(low) holds (0: trivially), serves(high) is assumed not to
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if serves(mid) else (low, mid)
    return low


def measure(g: ServingGraph, args: argparse.Namespace) -> dict:
    engine = g.create_engine()
    arch = engine.model_config
    layout = engine.layout
    itemsize = 4  # both run float32 here
    per_token = kv_bytes_per_token(arch, itemsize)
    if layout.paged:
        reserved = layout.num_blocks * layout.block_size * per_token
    else:
        reserved = (layout.max_slots * layout.max_model_len
                    + layout.num_blocks * layout.block_size) * per_token
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt = [1] + [5 + i % 200 for i in range(args.prompt_len - 1)]
    for i in range(args.requests):
        engine.add_request(str(i), prompt, params)
    running, saturated, finished = [], [], 0
    while engine.has_unfinished_requests():
        finished += sum(out.finished for out in engine.step())
        running.append(len(engine.scheduler.running))
        if len(engine.scheduler.waiting):  # memory (or slots), not the request count, decides
            saturated.append(running[-1])
    busiest = max(running)
    steady = statistics.median(saturated or running)
    return {
        "executor": g.executor.backend + ("" if g.executor.backend == "torch" else
                                          f" ({'paged' if layout.paged else 'slots'})"),
        "paged": layout.paged,
        "layout": {"max_slots": layout.max_slots, "max_model_len": layout.max_model_len,
                   "block_size": layout.block_size, "num_blocks": layout.num_blocks},
        "kv_reserved_bytes": reserved,
        "kv_bytes_per_token": per_token,
        "busiest_running": busiest,
        "median_running_while_requests_wait": steady,
        "kv_bytes_per_running_sequence": int(reserved / steady),
        "preemptions": engine.stats().num_preemptions,
        "steps": len(running),
        "finished": finished,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="32MiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kv_capacity.json")
    args = p.parse_args()
    budget_bytes = parse_memory(args.budget)
    slots = most_slots(args.budget, args.max_model_len)
    rows = [measure(graph(name, args.budget, args.max_model_len, args.max_num_seqs), args)
            for name in ("paged", "torch")]
    if slots:
        rows.append(measure(graph("onnxruntime", args.budget, args.max_model_len, slots), args))
    result = {"budget": args.budget, "budget_bytes": budget_bytes,
              "max_model_len": args.max_model_len, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "requests": args.requests,
              "tokens_per_sequence": args.prompt_len + args.output_len,
              "ideal_concurrency": (budget_bytes or 0) // (rows[0]["kv_bytes_per_token"]
                                                           * (args.prompt_len + args.output_len)),
              "executors": rows}
    for r in rows:  # the share of the ideal number of sequences each runs
        r["share_of_ideal"] = round(r["median_running_while_requests_wait"]
                                    / max(1, result["ideal_concurrency"]), 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"budget {args.budget}, sequences of {args.prompt_len}+{args.output_len} tokens, "
          f"max_model_len {args.max_model_len}: ideal {result['ideal_concurrency']} at once")
    for r in rows:
        print(f"  {r['executor']:<22} paged={r['paged']!s:<5} busiest {r['busiest_running']:>4} "
              f"median while requests wait {r['median_running_while_requests_wait']:>6} KV/seq {r['kv_bytes_per_running_sequence'] / 2**20:.2f} MiB "
              f"preemptions {r['preemptions']} ({r['share_of_ideal']:.0%} of ideal)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
