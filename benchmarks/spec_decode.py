"""Speculative decoding (n-gram prompt lookup) vs plain decoding, on the same engine, one run.

    python benchmarks/spec_decode.py                      # trained default + ~100M, batch 1 and 8
    python benchmarks/spec_decode.py --skip-100m --k 2 --k 4

For each model (the trained embedded ``tiny_llama``; a seeded random ~100M Llama), each batch
size and each prompt kind, the same greedy requests run through the offline ``LLM`` (ONNX
Runtime, continuous batching, prefix cache off so every run does the same prefill) without and
with ``speculative_config={"method": "ngram", "num_speculative_tokens": k}``:

- ``repetitive``: held-out documentation passages followed by the start of the same passage
  again (the model continues a copy: what prompt lookup is for) or code that repeats itself;
- ``plain``: the openings of held-out passages (nothing to copy but what the output repeats).

Reported per case: wall time of the whole batch (prefill included; best of ``--repeats``),
output tokens/s, engine steps, tokens per speculative row and step (1 + accepted / drafts),
draft acceptance, speedup over plain decoding, and whether every output equals the plain one
token for token (it must). Writes ``benchmarks/results/spec_decode.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow import LLM, SamplingParams  # noqa: E402
from inferflow.bench.suite import write_report  # noqa: E402
from inferflow.models.tiny import SPEC_100M, TRAINED, make_checkpoint, tiny_llama_path  # noqa: E402

OUT = REPO / "benchmarks" / "results"
CODE = ("def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
        "def write_config(path, data):\n    with open(path, 'w') as f:\n        json.dump(data, f)"
        "\n\n\ndef read_config(path):\n")


def passages(count: int) -> list[str]:
    """Held-out documentation paragraphs of 200-600 characters."""
    text = (TRAINED / "heldout.txt").read_text()
    paras = [p.strip() for p in text.split("\n\n") if 200 <= len(p.strip()) <= 600]
    return paras[:count]


def prompts(kind: str, batch: int) -> list[str]:
    paras = passages(batch)
    if kind == "repetitive":  # a passage, then its first half again: continue the copy
        out = [f"{p}\n\n{p[: len(p) // 2]}" for p in paras]
        out[0] = CODE
        return out
    return [p[:120] for p in paras]


def run(llm: LLM, texts: list[str], max_tokens: int, repeats: int) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(texts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm
    best, outs, steps = float("inf"), [], 0
    for _ in range(repeats):
        scheduler = llm.engine.scheduler
        steps_before = scheduler.stats.num_steps
        spec_before = (scheduler.spec_stats.num_drafts, scheduler.spec_stats.num_draft_tokens,
                       scheduler.spec_stats.num_accepted_tokens)
        started = time.perf_counter()
        result = llm.generate(texts, params)
        elapsed = time.perf_counter() - started
        if elapsed < best:
            best, outs = elapsed, [o.outputs[0].token_ids for o in result]
            steps = scheduler.stats.num_steps - steps_before
            spec = [a - b for a, b in zip((scheduler.spec_stats.num_drafts,
                                           scheduler.spec_stats.num_draft_tokens,
                                           scheduler.spec_stats.num_accepted_tokens),
                                          spec_before, strict=True)]
    tokens = sum(len(o) for o in outs)
    drafts, proposed, accepted = spec
    return {"seconds": round(best, 4), "output_tokens": tokens,
            "tokens_per_s": round(tokens / best, 1), "engine_steps": steps,
            "drafts": drafts, "draft_tokens": proposed, "accepted_tokens": accepted,
            "acceptance": round(accepted / proposed, 3) if proposed else None,
            "tokens_per_spec_step": round(1 + accepted / drafts, 2) if drafts else None,
            "outputs": outs}


def bench_model(name: str, path: Path, ks: list[int], batches: list[int], max_tokens: int,
                repeats: int, max_model_len: int) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        common = {"max_slots": batch, "max_num_seqs": batch, "max_model_len": max_model_len,
                  "enable_prefix_caching": False}
        plain_llm = LLM(path, **common)
        spec_llms = {k: LLM(path, speculative_config={"method": "ngram",
                                                      "num_speculative_tokens": k}, **common)
                     for k in ks}
        for kind in ("repetitive", "plain"):
            texts = prompts(kind, batch)
            plain = run(plain_llm, texts, max_tokens, repeats)
            for k, llm in spec_llms.items():
                spec = run(llm, texts, max_tokens, repeats)
                rows.append({
                    "model": name, "batch": batch, "prompts": kind, "k": k,
                    "plain_tokens_per_s": plain["tokens_per_s"],
                    "spec_tokens_per_s": spec["tokens_per_s"],
                    "speedup": round(plain["seconds"] / spec["seconds"], 2),
                    "plain_steps": plain["engine_steps"], "spec_steps": spec["engine_steps"],
                    "acceptance": spec["acceptance"],
                    "tokens_per_spec_step": spec["tokens_per_spec_step"],
                    "draft_tokens": spec["draft_tokens"], "accepted_tokens": spec["accepted_tokens"],
                    "identical_output": spec["outputs"] == plain["outputs"],
                })
                print(json.dumps(rows[-1]), flush=True)
    return rows


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Speculative decoding (n-gram) vs plain, {meta['date']}", "",
             f"{meta['cpus']} CPUs, {meta['platform']}; greedy, {meta['max_tokens']} new tokens "
             "per request, ONNX Runtime fp32, best of "
             f"{meta['repeats']}.", "",
             "| model | batch | prompts | k | plain tok/s | spec tok/s | speedup | steps plain/spec "
             "| acceptance | tokens/spec step | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['prompts']} | {r['k']} | "
            f"{r['plain_tokens_per_s']} | {r['spec_tokens_per_s']} | {r['speedup']}x | "
            f"{r['plain_steps']}/{r['spec_steps']} | {r['acceptance']} | "
            f"{r['tokens_per_spec_step']} | {r['identical_output']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, action="append", help="num_speculative_tokens (repeatable)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-100m", action="store_true")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/inferflow-bench"))
    args = ap.parse_args()
    ks = args.k or [4]
    rows = bench_model("tiny_llama (trained, 5.2M)", tiny_llama_path(), ks, args.batches,
                       args.max_tokens, args.repeats, 512)
    if not args.skip_100m:
        path = Path(args.workdir) / "llama-100m-spec"
        if not (path / "tokenizer_config.json").exists():
            make_checkpoint(path, SPEC_100M, seed=0)
        rows += bench_model("llama-100m (random)", path, ks, args.batches, args.max_tokens,
                            args.repeats, 512)
    meta = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
            "platform": platform.processor() or platform.machine(),
            "max_tokens": args.max_tokens, "repeats": args.repeats}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "spec_decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    failed = [r for r in rows if not r["identical_output"]]
    notes = [f"{len(failed)} case(s) whose output differs from plain decoding"] if failed else []
    write_report(OUT / "spec_decode.md", report(rows, meta), notes)


if __name__ == "__main__":
    main()
