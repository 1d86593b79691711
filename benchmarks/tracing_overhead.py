"""Tracing overhead on the real engine: the same offline workload with telemetry ``none`` (no
telemetry object), ``off`` (metrics only, spans dropped), ``file`` and ``otlp`` (gRPC; to
``--otlp-endpoint`` or to a throwaway in-process sink), interleaved over repeats.

    python benchmarks/tracing_overhead.py --requests 32 --max-tokens 32 --repeats 5 \\
        --output overhead.json

Per run: a fresh ``LLMEngine`` (empty prefix cache), all requests submitted at once, each with
an API-side root span and a W3C carrier (as the server does), greedy decoding to ``max_tokens``;
the timed region ends after the exporter flushed. Reports median wall time and the ratio to
``none`` per mode. A benchmark with an output file, never a timed assertion.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from inferflow import LLM
from inferflow.models.checkpoint import load_checkpoint
from inferflow.sampling_params import SamplingParams
from inferflow.telemetry.engine_telemetry import EngineTelemetry
from inferflow.telemetry.metrics import EngineMetrics
from inferflow.telemetry.setup import TracingConfig, get_tracer, setup_tracing, shutdown_tracing
from inferflow.telemetry.spans import RequestSpan, start_request_span
from inferflow.telemetry.traced_executor import TracedExecutor

MODES = ("none", "off", "file", "otlp")


def _sink_main(ports: Any, stop: Any) -> None:
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class _Discard(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Discard(), server)
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(grace=None)


def start_sink() -> tuple[Callable[[], None], str]:
    """A gRPC OTLP endpoint on 127.0.0.1 that discards spans, in its own process (a collector's
    CPU is not the server's); returns (stop function, endpoint)."""
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_sink_main, args=(ports, stop), daemon=True)
    proc.start()
    port = ports.get(timeout=60)

    def close() -> None:
        stop.set()
        proc.join(timeout=10)

    return close, f"http://127.0.0.1:{port}"


def _prompts(run: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(run)  # new prompts each run: no prefix reuse across runs
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_once(
    model: Path, mode: str, prompts: list[list[int]], max_tokens: int, cfg: TracingConfig | None
) -> dict:
    """One timed run; returns wall time, steps and tokens."""
    engine = LLM(model).engine  # the server's default engine, offline
    provider = setup_tracing(cfg) if cfg is not None else None
    telemetry = None
    if provider is not None:
        telemetry = EngineTelemetry(get_tracer(provider), EngineMetrics("bench"))
        # LLMEngine types .executor as PlanRunner; any Executor-protocol object works
        traced = TracedExecutor(engine.executor, telemetry, snapshot=lambda: engine.scheduler.stats)
        engine.executor = traced
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    roots: dict[str, RequestSpan] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, ids in enumerate(prompts):
        rid, now = f"r{i}", time.time()
        if telemetry is not None and provider is not None:
            roots[rid] = start_request_span(
                get_tracer(provider), operation="text_completion", model="bench"
            )
            telemetry.on_request_arrived(
                rid,
                num_prompt_tokens=len(ids),
                arrival_time=now,
                trace_context=roots[rid].trace_context,
            )
        engine.add_request(rid, ids, params, arrival_time=now)
    steps = tokens = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        for out in outputs:
            tokens += len(out.outputs[0].delta_token_ids)
            if out.finished and telemetry is not None:
                telemetry.on_request_finished(
                    out.request_id, out.outputs[0].finish_reason or "error", metrics=out.metrics
                )
                roots[out.request_id].end()
    if provider is not None:
        shutdown_tracing(provider)  # flush: export cost is part of the run
    return {
        "mode": mode,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
        "steps": steps,
        "tokens": tokens,
    }


def _config(mode: str, folder: Path, endpoint: str) -> TracingConfig | None:
    if mode == "none":
        return None
    if mode == "otlp":
        return TracingConfig(exporter="otlp", protocol="grpc", endpoint=endpoint)
    return TracingConfig(exporter=mode, file_path=str(folder / "traces.jsonl"))


def summarize(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per mode: median wall and CPU (all threads of this process) seconds, their ratios to
    ``none``, and the extra CPU microseconds per engine step."""
    out: dict[str, dict[str, float]] = {}
    steps = statistics.median(r["steps"] for r in runs)
    for mode in MODES:
        wall = statistics.median(r["seconds"] for r in runs if r["mode"] == mode)
        cpu = statistics.median(r["cpu_seconds"] for r in runs if r["mode"] == mode)
        out[mode] = {"median_s": wall, "median_cpu_s": cpu}
    for row in out.values():
        row["ratio_vs_none"] = row["median_s"] / out["none"]["median_s"]
        row["cpu_ratio_vs_none"] = row["median_cpu_s"] / out["none"]["median_cpu_s"]
        row["extra_cpu_us_per_step"] = (
            (row["median_cpu_s"] - out["none"]["median_cpu_s"]) / steps * 1e6
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python benchmarks/tracing_overhead.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model", help="checkpoint folder (default: the embedded tiny Llama)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--otlp-endpoint", help="OTLP gRPC endpoint (default: an in-process discarding sink)"
    )
    p.add_argument("--output", help="write the runs and the summary as JSON here")
    args = p.parse_args(argv)
    if args.model:
        model = Path(args.model)
    else:
        from inferflow.models.tiny import tiny_llama_path

        model = tiny_llama_path()
    close_sink, endpoint = (None, args.otlp_endpoint) if args.otlp_endpoint else start_sink()
    vocab = load_checkpoint(model).config.vocab_size
    runs: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="inferflow-overhead-") as tmp:
            for rep in range(args.repeats):
                prompts = _prompts(rep, args.requests, args.prompt_len, vocab)
                # interleaved, alternating direction: drift on a shared machine hits every mode
                for mode in MODES if rep % 2 == 0 else tuple(reversed(MODES)):
                    runs.append(
                        run_once(
                            model,
                            mode,
                            prompts,
                            args.max_tokens,
                            _config(mode, Path(tmp), endpoint),
                        )
                    )
    finally:
        if close_sink is not None:
            close_sink()
    summary = summarize(runs)
    for mode, row in summary.items():
        print(
            f"{mode:>5}: wall {row['median_s'] * 1e3:8.1f} ms (x{row['ratio_vs_none']:.3f})  "
            f"cpu {row['median_cpu_s'] * 1e3:8.1f} ms (x{row['cpu_ratio_vs_none']:.3f})  "
            f"{row['extra_cpu_us_per_step']:+8.1f} cpu-us/step"
        )
    if args.output:
        Path(args.output).write_text(
            json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
