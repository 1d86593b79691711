"""Decode throughput (tokens/s) of inferflow's engine vs transformers on the same checkpoint.

For each model (the embedded tiny_llama and a ~100M-parameter Llama made the same way) and each
batch size (1, 8, 32): B prompts of --prompt-len random tokens are prefilled, then --steps decode
steps are timed. inferflow runs through LLMEngine (scheduler + ORT engine + sampler, greedy);
transformers runs ``generate(do_sample=False)`` with the prefill-only time subtracted. Both use the
same torch/ORT thread count. Writes benchmarks/results/decode_throughput.json.

    python benchmarks/decode_throughput.py [--steps 32] [--batches 1 8 32] [--skip-100m]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from inferflow.engine.llm_engine import LLMEngine
from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.tiny import SPEC_100M, make_checkpoint, tiny_llama_path
from inferflow.runtimes.config import Precision
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.config import SchedulerConfig
from inferflow.scheduling.kv_cache_manager import KVCacheManager
from inferflow.scheduling.layout import KVLayout
from inferflow.scheduling.scheduler import Scheduler
from inferflow.stages.detokenizer import StreamingDetokenizer
from inferflow.stages.executor import OnnxRuntimeExecutor


def inferflow_decode(
    path: Path, batch: int, prompt_len: int, steps: int, threads: int, precision: str
) -> float:
    ck = load_checkpoint(path)
    # ONNX Runtime over ``batch`` slots of the prompt + the steps (capped at the checkpoint's
    # context), prefix cache off
    layout = KVLayout.plan(batch, min(prompt_len + steps + 8, ck.config.max_position_embeddings))
    executor = OnnxRuntimeExecutor(
        precision=Precision(precision), intra_op_threads=threads, allow_spinning=True
    )
    executor.load(ck, layout)
    budgets = SchedulerConfig(
        max_num_seqs=batch, max_num_batched_tokens=max(batch * prompt_len, 64)
    )
    kv = KVCacheManager(layout.num_blocks, layout.block_size, enable_prefix_caching=False)
    engine = LLMEngine(ck, executor, Scheduler(budgets, layout, kv=kv), StreamingDetokenizer())
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            str(i), rng.integers(5, ck.config.vocab_size, prompt_len).tolist(), params
        )
    produced = 0
    while produced < batch:  # prefill: every request has its first token
        produced += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    start = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def transformers_decode(path: Path, batch: int, prompt_len: int, steps: int, threads: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor(np.random.default_rng(0).integers(5, vocab, (batch, prompt_len)))
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        return time.perf_counter() - t

    run(2)  # warm-up
    prefill = run(1)
    total = run(steps + 1)
    return batch * steps / max(total - prefill, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--precisions", nargs="+", default=["fp32"])
    ap.add_argument("--skip-100m", action="store_true")
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "decode_throughput.json"
    )
    args = ap.parse_args()
    models = {"tiny_llama": tiny_llama_path()}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_100m:
            models["llama_100m"] = make_checkpoint(Path(tmp) / "llama_100m", SPEC_100M, seed=0)
        rows = []
        for name, path in models.items():
            params = load_checkpoint(path).config.num_parameters
            for batch in args.batches:
                ref = transformers_decode(path, batch, args.prompt_len, args.steps, args.threads)
                for precision in args.precisions:
                    ours = inferflow_decode(
                        path, batch, args.prompt_len, args.steps, args.threads, precision
                    )
                    rows.append(
                        {
                            "model": name,
                            "parameters": params,
                            "batch": batch,
                            "precision": precision,
                            "inferflow_tok_s": round(ours, 1),
                            "transformers_tok_s": round(ref, 1),
                            "ratio": round(ours / ref, 2),
                        }
                    )
                    print(
                        f"{name:11s} {params / 1e6:6.1f}M  batch {batch:3d}  {precision:5s}  inferflow "
                        f"{ours:9.1f} tok/s  transformers {ref:9.1f} tok/s  ratio {ours / ref:5.2f}x",
                        flush=True,
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "steps": args.steps,
        "prompt_len": args.prompt_len,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
