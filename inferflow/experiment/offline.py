"""``task=offline``: the engine alone (no HTTP), the synthetic ``offline`` workload, measured.

The engine is created and its KV memory made resident first; ``experiment.warmup`` unmeasured
passes of the workload follow (every shape the measured passes use is then compiled and cached),
then ``experiment.repeats`` measured passes on the same engine. Each pass submits
``offline.num_prompts`` random prompts at once and runs them to completion; its figures carry
vLLM's result keys, so offline and served results share one table.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from omegaconf import DictConfig

from inferflow.engine import LLMEngine
from inferflow.experiment.figures import MachineLoad, cpu_busy_pct_now
from inferflow.experiment.results import measured_result
from inferflow.graph import ServingGraph
from inferflow.outputs import RequestOutput
from inferflow.sampling_params import SamplingParams


def run(graph: ServingGraph, cfg: DictConfig) -> dict[str, Any]:
    """Measure the graph's engine on ``cfg.offline`` (see the module doc)."""
    params, experiment = cfg.offline, cfg.experiment
    engine = graph.create_engine()
    wait_resident(engine)
    busy_before = cpu_busy_pct_now(0.5)
    for i in range(int(experiment.warmup)):
        one_pass(engine, params, tag=f"warmup{i}")
    repeats = []
    with MachineLoad() as machine:
        for i in range(max(1, int(experiment.repeats))):
            repeats.append(one_pass(engine, params, tag=f"r{i}"))
    return measured_result(
        "offline",
        repeats,
        warmup=int(experiment.warmup),
        max_spread=float(experiment.max_spread),
        machine=machine,
        cpu_busy_before_pct=busy_before,
        extra={"batching": type(graph.engine_slots.get("batching")).__name__},
    )


def wait_resident(engine: LLMEngine, timeout_s: float = 600.0) -> None:
    """Wait until the executor says its KV memory is resident (``kv_resident`` in its stats;
    executors that do not say are taken as resident)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats: dict[str, float] = getattr(engine.executor, "stats", dict)()
        if stats.get("kv_resident", 1):
            return
        time.sleep(0.05)


def one_pass(engine: LLMEngine, params: DictConfig, tag: str) -> dict[str, Any]:
    """Submit the workload at once, run it to completion; figures under vLLM's keys (and the
    names earlier results files used: ``output_throughput_tok_s`` ...). Every pass draws its
    own prompts (from ``offline.seed`` and ``tag``), so a repeat never reads the previous pass's
    prompts from the prefix cache."""
    rng = random.Random(f"{params.seed}-{tag}")  # new prompts per pass: no prefix-cache hits
    vocab = engine.model_config.vocab_size
    sp = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.time()
    for i in range(params.num_prompts):
        ids = [rng.randrange(vocab) for _ in range(params.prompt_len)]
        engine.add_request(f"offline-{tag}-{i}", ids, sp, arrival_time=start)
    finished: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finished.extend(out for out in engine.step() if out.finished)
    wall = time.time() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in finished)
    in_tokens = sum(len(o.prompt_token_ids or []) for o in finished)
    metrics = [o.metrics for o in finished if o.metrics is not None]
    ttft = [1000 * ((m.first_token_time or m.arrival_time) - m.arrival_time) for m in metrics]
    e2el = [1000 * ((m.finished_time or m.arrival_time) - m.arrival_time) for m in metrics]
    tpot = [
        (e - t) / (len(o.outputs[0].token_ids) - 1)
        for o, t, e in zip(finished, ttft, e2el, strict=False)
        if len(o.outputs[0].token_ids) > 1
    ]
    figures: dict[str, Any] = {
        "duration": wall,
        "completed": len(finished),
        "request_throughput": len(finished) / wall if wall > 0 else 0.0,
        "output_throughput": out_tokens / wall if wall > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / wall if wall > 0 else 0.0,
        **_summary(ttft, "ttft"),
        **_summary(tpot, "tpot"),
        **_summary(e2el, "e2el"),
    }
    figures.update(  # the keys of results files before issue 42
        num_requests=len(finished),
        duration_s=wall,
        output_throughput_tok_s=figures["output_throughput"],
        request_throughput_req_s=figures["request_throughput"],
    )
    return figures


def _summary(values: list[float], name: str) -> dict[str, float | None]:
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        f"mean_{name}_ms": statistics.fmean(values),
        f"median_{name}_ms": statistics.median(values),
        f"p99_{name}_ms": p99,
    }
