"""The result JSON (vLLM ``bench serve`` layout) and the readable table printed after a run."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path

from inferflow.bench.metrics import percentile_key

HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def run_header(
    *,
    backend: str,
    label: str | None,
    model_id: str,
    tokenizer_id: str | None,
    num_prompts: int,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    metadata: dict[str, str] | None = None,
) -> dict[str, object]:
    """The setup keys vLLM writes before the metrics (``request_rate`` is ``"inf"`` when
    unbounded, since JSON has no infinity)."""
    header: dict[str, object] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": num_prompts,
    }
    header.update(metadata or {})
    header["request_rate"] = "inf" if math.isinf(request_rate) else request_rate
    header["burstiness"] = burstiness
    header["max_concurrency"] = max_concurrency
    return header


def _line(name: str, value: object, fmt: str = "") -> str:
    text = format(value, fmt) if value is not None else "n/a"
    return f"{name:<40} {text:<10}"


def format_table(
    result: Mapping[str, object], metrics: Sequence[str], percentiles: Sequence[float]
) -> str:
    """The summary vLLM prints, from a result dict (works on a loaded JSON file too)."""
    lines = [
        "{:=^50}".format(" Serving Benchmark Result "),
        _line("Successful requests:", result["completed"]),
        _line("Failed requests:", result["failed"]),
    ]
    if result.get("max_concurrency") is not None:
        lines.append(_line("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate", "inf") != "inf":
        lines.append(_line("Request rate configured (RPS):", result["request_rate"], ".2f"))
    lines += [
        _line("Benchmark duration (s):", result["duration"], ".2f"),
        _line("Total input tokens:", result["total_input_tokens"]),
        _line("Total generated tokens:", result["total_output_tokens"]),
        _line("Request throughput (req/s):", result["request_throughput"], ".2f"),
    ]
    if result.get("request_goodput") is not None:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"], ".2f"))
    lines += [
        _line("Output token throughput (tok/s):", result["output_throughput"], ".2f"),
        _line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f"),
        _line("Peak concurrent requests:", result["max_concurrent_requests"]),
        _line("Total token throughput (tok/s):", result["total_token_throughput"], ".2f"),
    ]
    for metric in metrics:
        short, title = HEADERS[metric]
        lines.append(f"{title:-^50}")
        lines.append(_line(f"Mean {short} (ms):", result[f"mean_{metric}_ms"], ".2f"))
        lines.append(_line(f"Median {short} (ms):", result[f"median_{metric}_ms"], ".2f"))
        for p in percentiles:
            key = percentile_key(p, metric)
            lines.append(_line(f"{key.split('_')[0].upper()} {short} (ms):", result[key], ".2f"))
    lines.append("=" * 50)
    return "\n".join(line.rstrip() for line in lines)


def default_filename(result: Mapping[str, object]) -> str:
    """vLLM's name: ``{label}-{rate}qps[-concurrency{N}]-{model}-{date}.json``."""
    concurrency = result.get("max_concurrency")
    conc = f"-concurrency{concurrency}" if concurrency is not None else ""
    model = str(result.get("model_id") or "model").split("/")[-1]
    label = result.get("label") or result.get("backend")
    rate = result.get("request_rate")
    rate_text = "inf" if rate == "inf" else str(float(rate if isinstance(rate, int | float) else 0))
    return f"{label}-{rate_text}qps{conc}-{model}-{result['date']}.json"


def save_result(result: Mapping[str, object], path: Path, append: bool = False) -> Path:
    """Write ``result`` as JSON (one object, or one more line with ``append``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+" if append else "w", encoding="utf-8") as f:
        if append and f.tell() != 0:
            f.write("\n")
        json.dump(result, f)
    return path
