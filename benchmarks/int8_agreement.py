#!/usr/bin/env python
"""Top-1 agreement of the 8-bit engines with fp32, teacher-forced, on a fixed set of prompts.

    python benchmarks/int8_agreement.py                      # the ~100M model
    python benchmarks/int8_agreement.py --model 4m5 --prompts 32

The reference is inferflow's fp32 ONNX Runtime engine: for each of ``--prompts`` seeded random
prompts of ``--prompt-len`` token ids it decodes ``--tokens`` tokens greedily. Every other engine
is fed the same prompt and then, step by step, the *reference's* tokens (teacher forcing), and
its argmax at each position is compared with the reference token there; agreement is the share
of positions that match. Engines:

- ``inferflow int8``: ``executor.precision=int8`` (weight-only int8, ``MatMulNBits`` with
  ``quant_accuracy_level`` 4 = int8 compute where the CPU has it);
- ``llama.cpp f32`` and ``llama.cpp Q8_0``: llama-server on the checkpoint converted by
  llama.cpp's converter (``--outtype f32`` / ``q8_0``), asked for one greedy token after each
  prefix (``/completion`` with token ids); f32 checks the method itself (same ids, same weights).

Writes ``benchmarks/results/int8_agreement-<model>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.peers import MODELS, add_path_args, checkpoint, gguf, q8_gguf  # noqa: E402
from inferflow.bench.suite import free_port, managed_server  # noqa: E402
from inferflow.models.checkpoint import load_checkpoint  # noqa: E402
from inferflow.runtimes.config import OrtSettings  # noqa: E402
from inferflow.runtimes.onnxruntime_runner import OnnxRuntimeRunner  # noqa: E402
from inferflow.runtimes.step_inputs import EngineRow  # noqa: E402
from inferflow.scheduling.layout import KVLayout  # noqa: E402


def runner(path: Path, precision: str) -> OnnxRuntimeRunner:
    return OnnxRuntimeRunner(load_checkpoint(path), OrtSettings(precision=precision),
                             KVLayout.plan(1, 512))


def forced(engine: OnnxRuntimeRunner, prompt: list[int], tokens: list[int] | None,
           n: int) -> list[int]:
    """Argmax after the prompt and after each of ``tokens`` (None: the engine's own greedy)."""
    out = [int(engine.forward([EngineRow(0, tuple(prompt), 0, True)])[0].argmax())]
    pos = len(prompt)
    for k in range(n - 1):
        fed = out[k] if tokens is None else tokens[k]
        out.append(int(engine.forward([EngineRow(0, (fed,), pos, True)])[0].argmax()))
        pos += 1
    return out


def llama_forced(url: str, prompt: list[int], tokens: list[int]) -> list[int]:
    """llama-server's greedy token after the prompt and after each prefix of ``tokens``."""
    out = []
    with httpx.Client(timeout=120) as client:
        for k in range(len(tokens)):
            r = client.post(f"{url}/completion", json={
                "prompt": prompt + tokens[:k], "n_predict": 1, "temperature": 0,
                "top_k": 1, "return_tokens": True, "ignore_eos": True})
            r.raise_for_status()
            out.append(int(r.json()["tokens"][0]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="100m")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    add_path_args(p, REPO / "benchmarks" / "results")
    args = p.parse_args()
    path = checkpoint(args.model, args.models_dir)
    vocab = MODELS[args.model].vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    fp32 = runner(path, "fp32")
    refs = [forced(fp32, pr, None, args.tokens) for pr in prompts]
    del fp32
    results: dict[str, float] = {}

    def agree(got: list[list[int]]) -> float:
        pairs = [(a, b) for g, r in zip(got, refs, strict=True) for a, b in zip(g, r, strict=True)]
        return sum(a == b for a, b in pairs) / len(pairs)

    int8 = runner(path, "int8")
    results["inferflow int8 (MatMulNBits, accuracy level 4)"] = agree(
        [forced(int8, pr, ref, args.tokens) for pr, ref in zip(prompts, refs, strict=True)])
    del int8
    binary = args.peers_dir / "llama.cpp-build" / "bin" / "llama-server"
    if binary.exists():
        for name, model_file in (("llama.cpp f32 GGUF", gguf(path, args.peers_dir)),
                                 ("llama.cpp Q8_0 GGUF", q8_gguf(path, args.peers_dir))):
            port = free_port()
            cmd = [str(binary), "-m", str(model_file), "--host", "127.0.0.1", "--port", str(port),
                   "-c", "2048", "-np", "1", "-t", str(os.cpu_count() or 1)]
            log = args.results_dir / "logs" / f"int8_agreement-{name.split()[1]}.log"
            with managed_server(cmd, port, log, timeout=300, ready_path="/health") as url:
                results[name] = agree([llama_forced(url, pr, ref)
                                       for pr, ref in zip(prompts, refs, strict=True)])
    else:
        print(f"llama-server not built ({binary}): only inferflow's int8 is measured")
    out = args.results_dir / f"int8_agreement-{args.model}.json"
    out.write_text(json.dumps({"model": args.model, "prompts": args.prompts,
                               "prompt_len": args.prompt_len, "tokens": args.tokens,
                               "top1_agreement_with_inferflow_fp32": results}, indent=2) + "\n")
    print(f"\n| engine | top-1 agreement with fp32 ({args.prompts} prompts x {args.tokens} "
          "positions) |\n|---|---|")
    for name, value in results.items():
        print(f"| {name} | {100 * value:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
