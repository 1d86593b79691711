#!/usr/bin/env python
"""Throughput with 0 %, 50 % and 100 % of the requests constrained by a JSON schema.

    python benchmarks/guided_throughput.py                  # the ~100M model, concurrency 32
    python benchmarks/guided_throughput.py --model tiny --requests 32

Starts ``python -m inferflow +model=local model.path=<a seeded ~100M Llama> batching=continuous``
once and, for each share of constrained requests, sends ``--requests`` chat requests (random
prompts, ``max_tokens`` 128, temperature 1, ``--concurrency`` at once); the constrained ones carry
``response_format: json_schema`` (a bounded order schema), the others are free (``ignore_eos``).
Reports output tokens/s, mean TTFT and TPOT, and the guided stage's mask time per step from
``/metrics`` (``inferflow:guided_mask_seconds``). Constrained answers end when their schema is
complete (shorter than the free ones, which run to ``max_tokens``), so compare TPOT and the mask
time per step rather than total tokens. A warm-up batch runs first and is not reported. Writes ``benchmarks/results/guided_throughput.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.bench.suite import free_port, stop_process_group, wait_ready  # noqa: E402
from inferflow.models.tiny import SPEC_100M, make_checkpoint, tiny_llama_path  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
        "status": {"enum": ["open", "paid", "shipped"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 8},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "note": {"type": "string", "maxLength": 40},
    },
    "required": ["id", "status", "items", "note"],
    "additionalProperties": False,
}
WORDS = [
    "order",
    "ship",
    "pay",
    "item",
    "quantity",
    "customer",
    "address",
    "the",
    "a",
    "of",
    "to",
    "and",
    "river",
    "light",
]


async def _one(
    client: httpx.AsyncClient, url: str, model: str, constrained: bool, seed: int, max_tokens: int
) -> tuple[float, float, int]:
    rng = random.Random(seed)
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": " ".join(rng.choices(WORDS, k=40))}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "order", "schema": SCHEMA},
        }
    else:
        body["ignore_eos"] = True
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    ttft = (first or end) - start
    tpot = (end - (first or end)) / max(1, tokens - 1)
    return ttft, tpot, tokens


async def _point(
    url: str, model: str, share: float, n: int, concurrency: int, max_tokens: int
) -> dict:
    sem = asyncio.Semaphore(concurrency)
    constrained = set(random.Random(1).sample(range(n), round(share * n)))
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency)) as client:

        async def run(i: int) -> tuple[float, float, int]:
            async with sem:
                return await _one(client, url, model, i in constrained, i, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(n)))
        wall = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    return {
        "constrained_share": share,
        "requests": n,
        "output_tokens": tokens,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(tokens / wall, 1),
        "mean_ttft_ms": round(1000 * sum(r[0] for r in results) / n, 1),
        "mean_tpot_ms": round(1000 * sum(r[1] for r in results) / n, 2),
    }


def _mask_metrics(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = count = 0.0
    for line in text.splitlines():
        if m := re.match(r"inferflow:guided_mask_seconds_(sum|count)\{.*\} (\S+)", line):
            if m.group(1) == "sum":
                total += float(m.group(2))
            else:
                count += float(m.group(2))
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["100m", "tiny"], default="100m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks/results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "100m":
            path = make_checkpoint(Path(tmp) / "llama_100m", SPEC_100M, seed=0)
        else:
            path = tiny_llama_path()
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = args.results / "logs/guided_throughput.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "inferflow",
            "+model=local",
            f"model.path={path}",
            f"server.port={port}",
            "batching=continuous",
            "tracing=off",
            f"batching.max_num_seqs={args.concurrency}",
        ]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        points = []
        try:
            wait_ready(proc, url, 900, log)
            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            # warm-up (not reported): the first full batch pays one-off costs
            asyncio.run(_point(url, model, 0.5, args.concurrency, args.concurrency, 16))
            for share in (0.0, 0.5, 1.0):
                before = _mask_metrics(url)
                point = asyncio.run(
                    _point(url, model, share, args.requests, args.concurrency, args.max_tokens)
                )
                after = _mask_metrics(url)
                steps = after[1] - before[1]
                point["guided_mask_ms_per_step"] = (
                    round(1000 * (after[0] - before[0]) / steps, 3) if steps else None
                )
                point["guided_steps"] = int(steps)
                points.append(point)
                print(json.dumps(point))
        finally:
            stop_process_group(proc)
    args.results.mkdir(parents=True, exist_ok=True)
    out_file = args.results / "guided_throughput.json"
    out_file.write_text(
        json.dumps(
            {"model": args.model, "concurrency": args.concurrency, "points": points}, indent=2
        )
        + "\n"
    )
    print(f"-> {out_file}")


if __name__ == "__main__":
    main()
