"""Telemetry on the real engine: ``LLMEngine`` (tiny seeded Llama on ONNX Runtime) with its
executor wrapped in ``TracedExecutor`` — the span tree, step links, prefix-cache and token
metrics must agree with what the engine itself reports (RequestOutput.metrics, scheduler stats)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from inferflow import LLM
from inferflow.engine.llm_engine import LLMEngine
from inferflow.models.tiny import TinySpec, make_checkpoint
from inferflow.outputs import RequestOutput
from inferflow.sampling_params import SamplingParams
from inferflow.telemetry import (
    EngineMetrics,
    EngineTelemetry,
    RequestTimings,
    TracedExecutor,
    get_tracer,
)
from inferflow.telemetry.trace_model import children_index, group_by_trace, spans_from_request

SHARED = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun " * 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("telemetry-engine") / "tiny"
    make_checkpoint(
        path, TinySpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4), seed=0
    )
    return path


def serve(
    engine: LLMEngine, telemetry: EngineTelemetry, prompts: dict[str, str], max_tokens: int
) -> dict[str, RequestOutput]:
    """Add the prompts (engine + telemetry), step to completion, report finished requests."""
    finals: dict[str, RequestOutput] = {}
    for rid, prompt in prompts.items():
        ids = engine.tokenizer.encode(prompt, add_special_tokens=True)
        now = time.time()
        engine.add_request(
            rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_time=now
        )
        telemetry.on_request_arrived(
            rid, num_prompt_tokens=len(ids), arrival_time=now, max_tokens=max_tokens
        )
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
                reason = out.outputs[0].finish_reason or "error"
                telemetry.on_request_finished(out.request_id, reason, metrics=out.metrics)
    return finals


def test_engine_spans_and_metrics_agree_with_the_engine(checkpoint: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = EngineMetrics("tiny", engine_index=0)
    telemetry = EngineTelemetry(get_tracer(provider), metrics)
    engine = LLM(checkpoint, max_slots=4, max_model_len=256).engine
    engine.executor = TracedExecutor(
        engine.executor, telemetry, snapshot=lambda: engine.scheduler.stats
    )

    first = serve(engine, telemetry, {"a": SHARED}, max_tokens=4)
    rest = serve(
        engine,
        telemetry,
        {"b": SHARED, "c": "Completely different words here", "d": "x y z"},
        max_tokens=6,
    )
    finals = {**first, **rest}
    assert telemetry.num_tracked == 0
    provider.shutdown()

    spans = spans_from_request(encode_spans(exporter.get_finished_spans()))
    traces = group_by_trace(spans)
    steps = [s for s in spans if s.name == "engine step"]
    llm = {s.attributes["inferflow.request.id"]: s for s in spans if s.name == "llm_request"}
    assert set(llm) == set(finals)
    for rid, out in finals.items():
        trace_spans = traces[llm[rid].trace_id]
        kids = {s.name for s in children_index(trace_spans)[llm[rid].span_id]}
        assert kids == {"queue", "compute", "detokenizer"}
        by_name = {s.name: s for s in trace_spans}
        # the detokenizer stage: one span from its first to its last run, one run per token
        detok = by_name["detokenizer"]
        assert detok.attributes["inferflow.stage.calls"] == out.metrics.detokenize.calls
        assert out.metrics.detokenize.calls == len(out.outputs[0].token_ids)
        assert 0 < detok.attributes["inferflow.stage.busy_time"] <= detok.duration_s + 1e-6
        # span times are the engine's own RequestMetrics timestamps
        expected = RequestTimings.from_metrics(out.metrics, len(out.outputs[0].token_ids))
        assert by_name["queue"].duration_s == pytest.approx(expected.queue_time, abs=2e-6)
        assert by_name["compute"].duration_s == pytest.approx(expected.inference_time, abs=2e-6)
        assert llm[rid].attributes["gen_ai.usage.output_tokens"] == len(out.outputs[0].token_ids)
        assert (
            llm[rid].attributes["gen_ai.usage.cache_read.input_tokens"]
            == out.metrics.num_cached_prompt_tokens
        )
        linked_steps = [
            s for s in steps if any(link.span_id == llm[rid].span_id for link in s.links)
        ]
        assert len(linked_steps) >= len(out.outputs[0].token_ids)  # one step per token at least
    assert finals["b"].metrics.num_cached_prompt_tokens > 0  # b reused a's prefix blocks
    stats = engine.scheduler.stats
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}

    def total(name: str) -> float:
        return sum(
            s.value for s in families[name].samples if s.name.endswith("_total") or s.name == name
        )

    assert total("vllm:prefix_cache_queries") == stats.prefix_cache_queries
    assert total("vllm:prefix_cache_hits") == stats.prefix_cache_hits > 0
    generated = sum(len(o.outputs[0].token_ids) for o in finals.values())
    assert total("vllm:generation_tokens") == generated
    assert total("vllm:prompt_tokens") == sum(
        s.attributes["inferflow.step.num_prefill_tokens"] for s in steps
    )
    ttft = next(
        s.value
        for s in families["vllm:time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    )
    assert ttft == len(finals)
