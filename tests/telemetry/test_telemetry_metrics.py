"""Prometheus metrics: exposition parses with the Prometheus text parser, histograms and counters
move by exactly what the two-request story recorded, in one process and merged across a launcher
and two spawned workers in multiprocess mode."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import pythonpath
from prometheus_client.parser import text_string_to_metric_families
from telemetry_scenarios import worker_side

from inferflow.telemetry import EngineMetrics, EngineTelemetry, ServerMetrics, render_metrics
from inferflow.telemetry.metrics_export import mark_process_dead

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """All samples as (sample name, labels, value); fails on anything the parser rejects."""
    return [
        (s.name, s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    ]


def value(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    hits = [
        v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())
    ]
    assert hits, f"no sample {name} {labels}"
    return sum(hits)


def check_story(samples: list, n_engines: int) -> None:
    """What ``worker_side`` records, times the number of engines that ran it."""
    k = n_engines
    assert value(samples, "vllm:time_to_first_token_seconds_count") == 2 * k
    assert value(samples, "vllm:time_to_first_token_seconds_sum") == pytest.approx(
        (0.010 + 0.014) * k
    )
    # inter-token gaps: r1 0.006, 0.004; r2 0.004, 0.004
    assert value(samples, "vllm:inter_token_latency_seconds_count") == 4 * k
    assert value(samples, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.018 * k)
    assert value(samples, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(
        (0.0205 + 0.022) * k
    )
    assert value(samples, "vllm:request_queue_time_seconds_sum") == pytest.approx(
        (0.005 + 0.009) * k
    )
    assert value(samples, "vllm:request_decode_time_seconds_sum") == pytest.approx(
        (0.0105 + 0.008) * k
    )
    assert value(samples, "vllm:request_success_total", finished_reason="length") == k
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == k
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 0
    assert value(samples, "vllm:prompt_tokens_total") == 12 * k
    assert value(samples, "vllm:generation_tokens_total") == 6 * k
    assert value(samples, "vllm:prefix_cache_queries_total") == 7 * k
    assert value(samples, "vllm:prefix_cache_hits_total") == 2 * k
    assert value(samples, "inferflow:batch_size_count") == 4 * k
    assert value(samples, "inferflow:batch_size_sum") == 6 * k
    # the 0.005 s queue time of r1 falls in le=0.005, r2's 0.009 s does not
    assert value(samples, "vllm:request_queue_time_seconds_bucket", le="0.005") == k
    labels = {"gen_ai_operation_name": "chat", "gen_ai_request_model": "tiny-llama"}
    assert value(samples, "gen_ai_server_time_to_first_token_seconds_count", **labels) == 2 * k
    assert value(samples, "gen_ai_server_request_duration_seconds_count", **labels) == 2 * k
    # TPOT per request: r1 (0.030 - 0.020) / 2, r2 (0.034 - 0.026) / 2
    assert value(
        samples, "gen_ai_server_time_per_output_token_seconds_sum", **labels
    ) == pytest.approx(0.009 * k)
    for engine in map(str, range(n_engines)):  # gauges: one series per engine, last step's state
        assert value(samples, "vllm:num_requests_running", engine=engine) == 1
        assert value(samples, "inferflow:kv_cache_blocks_used", engine=engine) == 1
        assert value(samples, "inferflow:kv_cache_blocks_free", engine=engine) == 15
        assert value(samples, "vllm:kv_cache_usage_perc", engine=engine) == pytest.approx(1 / 16)
        assert value(samples, "inferflow:prefix_cache_hit_rate", engine=engine) == pytest.approx(
            2 / 7
        )


def test_histograms_move_after_requests() -> None:
    metrics = EngineMetrics("tiny-llama")
    before = parse(metrics.render().decode())
    assert value(before, "vllm:e2e_request_latency_seconds_count") == 0
    assert value(before, "vllm:time_to_first_token_seconds_count") == 0
    worker_side(EngineTelemetry(None, metrics), {"r1": None, "r2": None}, 1000.0)
    after = parse(metrics.render().decode())
    assert value(after, "vllm:e2e_request_latency_seconds_count") == 2
    check_story(after, n_engines=1)


def test_render_combines_in_memory_registries() -> None:
    engine, server = EngineMetrics("m"), ServerMetrics("m")
    server.on_response("/v1/completions", 429)
    server.on_response("/v1/completions", 200, 0.25)
    body, content_type = render_metrics(engine.registry, server.registry, multiprocess_dir=None)
    samples = parse(body.decode())
    assert content_type.startswith("text/plain")
    assert value(samples, "inferflow:http_requests_total", status_code="429") == 1
    assert (
        value(samples, "inferflow:http_request_duration_seconds_count", route="/v1/completions")
        == 1
    )
    assert value(samples, "vllm:num_requests_waiting") == 0


@pytest.mark.skipif(
    sys.platform == "win32", reason="multiprocess mode needs fork/spawn + mmap files"
)
def test_multiprocess_mode_merges_launcher_and_two_workers(tmp_path: Path) -> None:
    directory = tmp_path / "prom"
    env = {**os.environ, "PYTHONPATH": pythonpath(HERE)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    code = f"import telemetry_scenarios as s; print(s.metrics_launcher_main({str(directory)!r}))"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    samples = parse(proc.stdout)
    check_story(samples, n_engines=2)
    # the launcher's own (file-backed) HTTP counter is counted exactly once
    assert value(samples, "inferflow:http_requests_total", status_code="200") == 1
    # a dead worker's gauges can be dropped while its counters stay
    worker_pids = {p.stem.rsplit("_", 1)[1] for p in directory.glob("gauge_*.db")}
    assert len(worker_pids) == 2
    for pid in worker_pids:
        mark_process_dead(int(pid), directory)
    body, _ = render_metrics(multiprocess_dir=directory)
    remaining = parse(body.decode())
    assert not [s for s in remaining if s[0] == "vllm:num_requests_running"]
    assert value(remaining, "vllm:prompt_tokens_total") == 24


def test_a_new_server_removes_metrics_folders_of_dead_ones(tmp_path: Path) -> None:
    import subprocess
    import sys

    from inferflow.telemetry.metrics_export import DIR_PREFIX, remove_stale_multiprocess_dirs

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f"{DIR_PREFIX}{int(dead.stdout)}-abc"  # a kill -9'd server's folder
    live = tmp_path / f"{DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / f"{DIR_PREFIX}notapid"
    for folder in (stale, live, other):
        folder.mkdir()
        (folder / "gauge_mostrecent_1.db").write_bytes(b"x")
    assert remove_stale_multiprocess_dirs(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and other.exists()
