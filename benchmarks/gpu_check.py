#!/usr/bin/env python
"""One GPU check of the torch executor, in one go (≤ 6 minutes on one GPU; run by gpu_check.sh).

1. greedy output of ``executor=torch device=cuda`` against ``transformers`` on the same seeded
   checkpoints, float32 (token for token) and bfloat16 (the agreeing prefix is reported; the
   first tokens must agree), through the real engine (scheduler, paged KV, CUDA graphs);
2. the Triton paged decode kernel against the gather + SDPA reference;
3. CUDA-graph replay against the same step run without graphs;
4. decode tokens/s at batch 1, 32 and 128 on the ~100M checkpoint (bfloat16);
5. a short serving run: ``python -m inferflow ... executor=torch executor.device=cuda``, 64
   streamed requests at concurrency 32.

``--device cpu`` runs checks 1, 4 (float32, batch 1 and 8) and 5 on the CPU with the same code
(a rehearsal of the script where there is no GPU; the kernel and graph checks need CUDA and are
skipped; ``GPU_CHECK_TIMEOUT=900`` gives it the time a CPU needs).

Prints one line per check and writes ``$OUT/gpu_check.json`` (or
``benchmarks/results/gpu_check.json``). Exit status 0 only when every check passed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from inferflow.engine.llm_engine import LLMEngine  # noqa: E402
from inferflow.models.checkpoint import load_checkpoint  # noqa: E402
from inferflow.models.tiny import SPEC_100M, TinySpec, make_checkpoint  # noqa: E402
from inferflow.runtimes.step_inputs import EngineRow  # noqa: E402
from inferflow.sampling_params import SamplingParams  # noqa: E402
from inferflow.scheduling.config import SchedulerConfig  # noqa: E402
from inferflow.scheduling.kv_cache_manager import KVCacheManager  # noqa: E402
from inferflow.scheduling.layout import KVLayout  # noqa: E402
from inferflow.scheduling.scheduler import Scheduler  # noqa: E402
from inferflow.stages.detokenizer import StreamingDetokenizer  # noqa: E402
from inferflow.stages.torch_executor import TorchExecutor  # noqa: E402

WORK = Path(tempfile.mkdtemp(prefix="inferflow-gpu-check-"))
RESULTS: dict[str, Any] = {"device": None, "checks": {}}
DEVICE = "cuda"
PROMPTS = ["Hello, world! The moon", "def add(a, b):", "Once upon a time there was a robot"]


def engine(path: Path, dtype: str, max_num_seqs: int = 8, num_blocks: int = 512,
           max_model_len: int = 512, graphs: bool = True) -> LLMEngine:
    checkpoint = load_checkpoint(path)
    layout = KVLayout(max_num_seqs, max_model_len, 16, num_blocks, paged=True)
    executor = TorchExecutor(device=DEVICE, dtype=dtype, cuda_graphs=graphs,  # type: ignore[arg-type]
                             cache_dir=str(WORK / "engines"))
    executor.load(checkpoint, layout)
    budgets = SchedulerConfig(max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max(512, max_num_seqs))
    kv = KVCacheManager(layout.num_blocks, layout.block_size, enable_prefix_caching=True)
    return LLMEngine(checkpoint, executor, Scheduler(budgets, layout, kv=kv), StreamingDetokenizer())


def generate(e: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def check_parity() -> None:
    import transformers

    path = WORK / "gqa8x2"
    make_checkpoint(path, TinySpec(), seed=1)
    tok = load_checkpoint(path).tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    for dtype, tdtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=tdtype).to(DEVICE)
        refs = []
        for p in prompts:
            ids = torch.tensor([p], device=DEVICE)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            refs.append(out[0].tolist()[len(p):])
        del model
        ours = generate(engine(path, dtype), prompts, 32)
        agree = [next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
                 for o, r in zip(ours, refs, strict=True)]
        ok = ours == refs if dtype == "float32" else min(agree) >= 4
        record(f"greedy_vs_transformers_{dtype}", ok, {"agreeing_tokens": agree, "of": 32})


def check_kernel() -> None:
    from inferflow.runtimes.torch_engine.attention import reference_attention
    from inferflow.runtimes.torch_engine.triton_paged import paged_decode_attention

    torch.manual_seed(0)
    worst = 0.0
    for blocks, bs, hkv, d, hq, dtype in [(64, 16, 2, 64, 8, torch.float32),
                                          (256, 16, 8, 128, 32, torch.bfloat16),
                                          (40, 8, 1, 32, 8, torch.float16)]:
        k = torch.randn(blocks, bs, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(blocks, bs, hkv, d, device="cuda", dtype=dtype)
        lens = torch.randint(1, 8 * bs, (32,), dtype=torch.int32, device="cuda")
        tables = torch.randint(0, blocks, (32, 8), dtype=torch.int32, device="cuda")
        q = torch.randn(32, hq, d, device="cuda", dtype=dtype)
        starts = torch.arange(33, dtype=torch.int32, device="cuda")
        ref = reference_attention(q.float(), k.float(), v.float(), tables, lens, starts, d**-0.5)
        out = paged_decode_attention(q, k, v, tables, lens, d**-0.5).float()
        worst = max(worst, (ref - out).abs().max().item())
    record("paged_decode_kernel", worst < 2e-2, {"max_abs_error": worst})


def check_graph_replay() -> None:
    path = WORK / "gqa8x2"
    e = engine(path, "float32", max_num_seqs=8)
    runner = e.model_executor.runner
    rows = [EngineRow(i, (7 + i,), 5 + i, True, (i,)) for i in range(5)]
    graphs = runner.graphs
    with_graphs = runner.forward(rows)
    runner.graphs = None
    without = runner.forward(rows)
    runner.graphs = graphs
    err = float(abs(with_graphs - without).max())
    record("cuda_graph_replay", graphs is not None and err < 1e-4,
           {"graphs": graphs.num_graphs if graphs else 0, "max_abs_error": err})


def check_decode_throughput() -> None:
    path = WORK / "llama-100m"
    make_checkpoint(path, SPEC_100M, seed=0)
    dtype, batches = ("bfloat16", (1, 32, 128)) if DEVICE == "cuda" else ("float32", (1, 8))
    e = engine(path, dtype, max_num_seqs=max(batches), num_blocks=max(batches) * 16,
               max_model_len=256)
    runner = e.model_executor.runner
    figures = {}
    for batch in batches:
        rows = [EngineRow(i, (5,), 64, True, tuple(range(i * 16, i * 16 + 16)))
                for i in range(batch)]
        for _ in range(5):
            runner.forward(rows)
        sync()
        steps, start = (50 if DEVICE == "cuda" else 5), time.perf_counter()
        for _ in range(steps):
            runner.forward(rows)
        sync()
        figures[f"batch_{batch}_tok_s"] = round(batch * steps / (time.perf_counter() - start), 1)
    record(f"decode_throughput_100m_{dtype}", True, figures)


def check_serving() -> None:
    from inferflow.bench.suite import free_port, managed_server, run_points

    path = WORK / "llama-100m"
    port = free_port()
    env_home = WORK / "home"
    os.environ["INFERFLOW_HOME"] = str(env_home)
    overrides = ["+model=local", f"model.path={path}", "executor=torch", f"executor.device={DEVICE}",
                 f"executor.dtype={'bfloat16' if DEVICE == 'cuda' else 'float32'}",
                 f"executor.cache_dir={WORK / 'engines'}", f"server.port={port}", "tracing=off",
                 "batching.max_num_seqs=64"]
    out_dir = WORK / "serve"
    with managed_server([sys.executable, "-m", "inferflow", *overrides], port,
                        out_dir / "server.log", timeout=240) as url:
        notes = run_points(url, "gpu-torch", [32], [
            "--model", path.name, "--dataset-name", "random", "--random-input-len", "128",
            "--random-output-len", "64", "--num-prompts", "64", "--num-warmups", "2"], out_dir)
    result = json.loads((out_dir / "gpu-torch-c32.json").read_text())
    record("serving_c32", not notes and result.get("failed", 1) == 0,
           {k: result.get(k) for k in ("completed", "failed", "output_throughput",
                                       "median_ttft_ms", "median_tpot_ms")})


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def record(name: str, ok: bool, details: dict[str, Any]) -> None:
    RESULTS["checks"][name] = {"ok": bool(ok), **details}
    print(f"{'PASS' if ok else 'FAIL'} {name}: {json.dumps(details)}", flush=True)


def main() -> int:
    global DEVICE
    DEVICE = "cpu" if "--device" in sys.argv and sys.argv[-1] == "cpu" else "cuda"
    checks = [check_kernel, check_parity, check_graph_replay, check_decode_throughput,
              check_serving]
    if DEVICE == "cpu":
        checks = [check_parity, check_decode_throughput, check_serving]
        RESULTS["device"] = "cpu (rehearsal)"
    elif not torch.cuda.is_available():
        print("no CUDA device: torch", torch.__version__, "CUDA", torch.version.cuda)
        return 2
    else:
        RESULTS["device"] = torch.cuda.get_device_name(0)
    RESULTS["torch"] = torch.__version__
    print("device:", RESULTS["device"], "torch", torch.__version__, flush=True)
    start = time.perf_counter()
    for check in checks:
        try:
            check()
        except Exception as exc:  # one failing check must not hide the others' results
            traceback.print_exc()
            record(check.__name__.removeprefix("check_"), False, {"error": repr(exc)})
    RESULTS["wall_s"] = round(time.perf_counter() - start, 1)
    out = Path(os.environ.get("OUT") or REPO / "benchmarks" / "results") / "gpu_check.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(RESULTS, indent=2) + "\n")
    print(f"wrote {out} in {RESULTS['wall_s']} s")
    return 0 if all(c["ok"] for c in RESULTS["checks"].values()) else 1


if __name__ == "__main__":
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                        "--format=csv"], check=False)
    raise SystemExit(main())
