#!/usr/bin/env python
"""Decode tok/s of a mixture-of-experts checkpoint beside a dense one with the same *active*
parameters, same run, through the real engine (issue 39: the MoE must cost within 1.5x the
dense model, not the cost of all its experts).

    python benchmarks/moe_decode.py                         # ORT fp32 + int8, torch fp32
    python benchmarks/moe_decode.py --executors ort:fp32 --batches 1 32 --steps 16

Seeded checkpoints written by transformers' own ``save_pretrained``: a Mixtral of ``--experts``
experts of intermediate size ``--expert-size``, top-``--top-k``; a Mistral (the same decoder
with a dense MLP) of intermediate size top_k x expert size (the same active parameters); and a
Mistral whose MLP is as wide as all the experts together (what computing every expert would
cost). Hidden size, layers, heads and vocabulary are equal. Each executor (``ort:<precision>``:
the ONNX Runtime CPU form; ``torch:<dtype>``: the torch engine, compiled by Inductor) serves
each at each batch size: B random prompts of ``--prompt-len`` tokens are prefilled, then
``--steps`` decode steps of the ``LLMEngine`` (scheduler, executor, sampler; greedy) are timed.
The best of ``--repeats`` runs is kept, the models' runs alternating (a shared machine's load
falls on all alike). ``ratio`` = dense tok/s / MoE tok/s. Writes
``benchmarks/results/moe_decode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from inferflow.engine.llm_engine import LLMEngine
from inferflow.models.checkpoint import Checkpoint, load_checkpoint
from inferflow.models.tiny import train_tokenizer
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.config import SchedulerConfig
from inferflow.scheduling.kv_cache_manager import KVCacheManager
from inferflow.scheduling.layout import KVLayout
from inferflow.scheduling.scheduler import Scheduler
from inferflow.stages.detokenizer import StreamingDetokenizer
from inferflow.stages.executor import ExecutorStage, OnnxRuntimeExecutor

RESULTS = Path(__file__).resolve().parent / "results"


def save_checkpoint(path: Path, architecture: str, config: dict[str, Any], seed: int = 0) -> Path:
    """A seeded ``architecture`` checkpoint saved by transformers, with inferflow's tokenizer."""
    import torch
    import transformers

    hf_config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**config)
    model = getattr(transformers, architecture)(hf_config).to(torch.float32)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            value = 1 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight") else \
                rng.standard_normal(shape) / np.sqrt(shape[-1])
            p.copy_(torch.from_numpy(value.astype(np.float32)))
    model.save_pretrained(path)
    train_tokenizer(hf_config.vocab_size, path)
    return path


def executor(spec: str, threads: int, cache_dir: str) -> ExecutorStage:
    kind, precision = spec.split(":")
    if kind == "ort":
        return OnnxRuntimeExecutor(precision=precision, intra_op_threads=threads,  # type: ignore[arg-type]
                                   allow_spinning=True, cache_dir=cache_dir)
    import torch._dynamo.config

    from inferflow.stages.torch_executor import TorchExecutor

    # each loaded engine compiles TorchLlama.forward twice (mixed and decode steps) for its own
    # module: this process loads six, past dynamo's default of 8 compilations of one frame
    torch._dynamo.config.recompile_limit = 64
    return TorchExecutor(dtype=precision, threads=threads, cache_dir=cache_dir)  # type: ignore[arg-type]


def decode_tok_s(ck: Checkpoint, stage: ExecutorStage, layout: KVLayout, prompt_len: int, steps: int,
                 seed: int) -> float:
    """Decode tokens per second of ``layout.max_slots`` greedy requests on a loaded ``stage``."""
    batch = layout.max_slots
    budgets = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(batch * prompt_len, 64))
    kv = KVCacheManager(layout.num_blocks, layout.block_size, enable_prefix_caching=False)
    engine = LLMEngine(ck, stage, Scheduler(budgets, layout, kv=kv), StreamingDetokenizer())
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), rng.integers(5, ck.config.vocab_size, prompt_len).tolist(), params)
    produced = 0
    while produced < batch:  # prefill: every request has its first token
        produced += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    start, tokens = time.perf_counter(), 0
    for _ in range(steps):
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def compare(models: dict[str, Checkpoint], spec: str, batch: int, args: argparse.Namespace,
            cache_dir: str) -> dict[str, float]:
    """Best decode tok/s of each model over ``args.repeats`` runs, the models' runs alternating
    (a shared machine's load then falls on both alike)."""
    layout = KVLayout.plan(batch, args.prompt_len + args.steps + 8, paged=spec.startswith("torch"))
    stages = {}
    for name, ck in models.items():
        stages[name] = executor(spec, args.threads, cache_dir)
        stages[name].load(ck, layout)
    best = dict.fromkeys(models, 0.0)
    for repeat in range(args.repeats):
        for name, ck in models.items():
            best[name] = max(best[name], decode_tok_s(ck, stages[name], layout, args.prompt_len, args.steps, repeat))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-size", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--executors", nargs="+", default=["ort:fp32", "ort:int8", "torch:float32"])
    ap.add_argument("--out", type=Path, default=RESULTS / "moe_decode.json")
    args = ap.parse_args()
    common = {"vocab_size": args.vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024,
              "bos_token_id": 0, "eos_token_id": 4, "pad_token_id": 1, "tie_word_embeddings": False}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "moe": load_checkpoint(save_checkpoint(Path(tmp) / "moe", "MixtralForCausalLM", {
                **common, "intermediate_size": args.expert_size, "num_local_experts": args.experts,
                "num_experts_per_tok": args.top_k})),
            "dense": load_checkpoint(save_checkpoint(Path(tmp) / "dense", "MistralForCausalLM", {
                **common, "intermediate_size": args.top_k * args.expert_size})),
            # what computing every expert would cost: a dense MLP as wide as all the experts
            "dense_all": load_checkpoint(save_checkpoint(Path(tmp) / "dense_all", "MistralForCausalLM", {
                **common, "intermediate_size": args.experts * args.expert_size})),
        }
        for name, ck in models.items():
            print(f"{name}: {ck.config.num_parameters / 1e6:.1f}M parameters, "
                  f"{ck.config.active_parameters / 1e6:.1f}M active")
        for spec in args.executors:
            for batch in args.batches:
                tok_s = compare(models, spec, batch, args, str(Path(tmp) / "engines"))
                ratio = tok_s["dense"] / tok_s["moe"]
                rows.append({"executor": spec, "batch": batch, "moe_tok_s": round(tok_s["moe"], 1),
                             "dense_tok_s": round(tok_s["dense"], 1), "ratio": round(ratio, 2),
                             "dense_all_tok_s": round(tok_s["dense_all"], 1)})
                print(f"{spec:14s} batch {batch:3d}  moe {tok_s['moe']:8.1f} tok/s  dense "
                      f"{tok_s['dense']:8.1f} tok/s  dense/moe {ratio:4.2f}x  (all experts dense: "
                      f"{tok_s['dense_all']:8.1f} tok/s)", flush=True)
        params = {name: {"parameters": ck.config.num_parameters, "active": ck.config.active_parameters}
                  for name, ck in models.items()}
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
            "load_average": os.getloadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **{k: v for k, v in vars(args).items() if k not in ("out", "executors", "batches")}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "models": params, "results": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
