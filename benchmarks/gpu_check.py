#!/usr/bin/env python
"""One GPU check of the torch executor, in one go (≤ 8 minutes on one GPU; run by gpu_check.sh).

1. ``parity``: greedy output of ``executor=torch`` against ``transformers`` on the same seeded
   checkpoint and device, float32 (token for token) and bfloat16 (the agreeing prefix is
   reported; the first 4 tokens must agree), through the real engine (scheduler, paged KV,
   CUDA graphs);
2. ``kernels``: the Triton split-K decode kernel and the varlen extend kernel against
   ``reference_attention`` (shuffled blocks, odd lengths, GQA 1/4/8, windows, soft-capping);
3. ``cuda_graph_replay``: a decode step replayed from a captured graph against the same step
   run without graphs;
4. ``decode``: decode tokens/s at batch 1, 32 and 128 on a seeded ~1B bfloat16 Llama
   (``SPEC_1B``), each with the bytes a step reads (weights + the rows' KV) over its time as a
   fraction of the chip's memory bandwidth (its datasheet figure, and a measured device copy);
5. ``prefill``: one step of 8 rows x 512 prompt tokens on the same model: TFLOP/s (2 x
   parameters per token plus the causal attention's products) against the chip's dense bf16
   figure;
6. ``serving_c32``: ``python -m inferflow ... executor=torch executor.device=cuda`` serving the
   ~100M checkpoint, 64 streamed requests at concurrency 32 through the project's bench.

``--rehearse`` runs the same path on the CPU with tiny sizes (a 2-layer model for both the
"~1B" and the served one, batches 1 and 4, a 2 x 16-token prefill, eager mode, concurrency 4,
the kernels under ``TRITON_INTERPRET=1``; CUDA-graph replay is reported as skipped): what
``tests/bench/test_gpu_check.py`` runs, so the script cannot rot between GPU runs.

A budget (``--budget``, seconds) bounds the whole run: a check that would start with less than
its own estimate left is recorded as skipped, not run. Prints one line per check and writes one
JSON (``--out``; default ``$OUT/gpu_check.json`` or ``benchmarks/results/gpu_check.json``).
Exit status 0 only when every check that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# datasheet figures: HBM bandwidth (bytes/s) and dense bf16 tensor throughput (FLOP/s)
CHIPS = {
    "H200": (4.8e12, 989e12),
    "H100 NVL": (3.9e12, 835e12),
    "H100 PCIe": (2.0e12, 756e12),
    "H100": (3.35e12, 989e12),
    "A100": (2.0e12, 312e12),
}
PROMPTS = ["Hello, world! The moon", "def add(a, b):", "Once upon a time there was a robot"]


@dataclass
class Run:
    """What one run of the check uses: the device, the sizes, where it writes."""

    device: str
    rehearse: bool
    work: Path
    deadline: float
    results: dict[str, Any]

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def record(self, name: str, ok: bool | None, details: dict[str, Any]) -> None:
        """``ok`` None: skipped (counts as neither pass nor fail)."""
        self.results["checks"][name] = {"ok": ok, **details}
        word = "SKIP" if ok is None else ("PASS" if ok else "FAIL")
        print(f"{word} {name}: {json.dumps(details)}", flush=True)

    def sync(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()


def spec_1b(rehearse: bool) -> Any:
    """The decode/prefill model: ~1.04B parameters (16 layers, hidden 2048, GQA 32/8, vocab
    16,384); a 2-layer one when rehearsing."""
    from inferflow.models.tiny import TinySpec

    if rehearse:
        return TinySpec(
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            vocab_size=512,
        )
    return TinySpec(
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        vocab_size=16384,
    )


def make_engine(
    run: Run,
    path: Path,
    dtype: str,
    max_num_seqs: int = 8,
    num_blocks: int = 512,
    max_model_len: int = 512,
    graphs: bool = True,
) -> Any:
    from inferflow.engine.llm_engine import LLMEngine
    from inferflow.models.checkpoint import load_checkpoint
    from inferflow.scheduling.config import SchedulerConfig
    from inferflow.scheduling.kv_cache_manager import KVCacheManager
    from inferflow.scheduling.layout import KVLayout
    from inferflow.scheduling.scheduler import Scheduler
    from inferflow.stages.detokenizer import StreamingDetokenizer
    from inferflow.stages.torch_executor import TorchExecutor

    checkpoint = load_checkpoint(path)
    layout = KVLayout(max_num_seqs, max_model_len, 16, num_blocks, paged=True)
    executor = TorchExecutor(
        device=run.device,
        dtype=dtype,
        cuda_graphs=graphs,  # type: ignore[arg-type]
        compile="eager" if run.rehearse else "inductor",  # type: ignore[arg-type]
        cache_dir=str(run.work / "engines"),
    )
    executor.load(checkpoint, layout)
    budgets = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max(512, max_num_seqs)
    )
    kv = KVCacheManager(layout.num_blocks, layout.block_size, enable_prefix_caching=True)
    return LLMEngine(
        checkpoint, executor, Scheduler(budgets, layout, kv=kv), StreamingDetokenizer()
    )


def generate(engine: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from inferflow.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def tiny_checkpoint(run: Run) -> Path:
    from inferflow.models.tiny import TinySpec, make_checkpoint

    path = run.work / "tiny"
    if not (path / "config.json").exists():
        make_checkpoint(path, TinySpec(), seed=1)
    return path


def check_parity(run: Run) -> None:
    import torch
    import transformers

    from inferflow.models.checkpoint import load_checkpoint

    path = tiny_checkpoint(run)
    tok = load_checkpoint(path).tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    n = 8 if run.rehearse else 32
    for dtype, tdtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=tdtype).to(run.device)
        refs = []
        for p in prompts:
            ids = torch.tensor([p], device=run.device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            refs.append(out[0].tolist()[len(p) :])
        del model
        ours = generate(make_engine(run, path, dtype), prompts, n)
        agree = [
            next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
            for o, r in zip(ours, refs, strict=True)
        ]
        ok = ours == refs if dtype == "float32" else min(agree) >= 4
        run.record(f"parity_{dtype}", ok, {"agreeing_tokens": agree, "of": n})


def kernel_errors(device: str, rehearse: bool) -> dict[str, float]:
    """Worst absolute error of each kernel against ``reference_attention`` (float32 reference),
    per case: shuffled blocks, odd lengths, GQA 1/4/8, windows, soft-capping, fp32/bf16."""
    import torch

    from inferflow.runtimes.torch_engine.attention import reference_attention
    from inferflow.runtimes.torch_engine.triton_extend import paged_extend_attention
    from inferflow.runtimes.torch_engine.triton_paged import paged_decode_attention

    torch.manual_seed(0)
    worst: dict[str, float] = {}
    dtypes = [torch.float32] if rehearse else [torch.float32, torch.bfloat16]
    heads = [(2, 2), (4, 1), (8, 1)] if rehearse else [(8, 8), (32, 8), (32, 4), (64, 8)]
    bs, d = (4, 16) if rehearse else (16, 128)
    for dtype in dtypes:
        for hq, hkv in heads:
            for window, softcap in [(0, 0.0), (37, 0.0), (0, 30.0)]:
                lens = [1, 5, 33, 3 * bs + 1] if rehearse else [1, 77, 1000, 4097, 513, 2048 + 3]
                q_lens = [1, 5, 2, 1] if rehearse else [1, 77, 300, 1, 129, 2048]
                blocks = sum(-(-n // bs) for n in lens) + 4
                k = torch.randn(blocks, bs, hkv, d, device=device).to(dtype)
                v = torch.randn(blocks, bs, hkv, d, device=device).to(dtype)
                perm = torch.randperm(blocks).tolist()
                width, used, table = max(-(-n // bs) for n in lens), 0, []
                for n in lens:
                    need = -(-n // bs)
                    table.append(perm[used : used + need] + [perm[0]] * (width - need))
                    used += need
                tables = torch.tensor(table, dtype=torch.int32, device=device)
                seq = torch.tensor(lens, dtype=torch.int32, device=device)
                ref_args = (k.float(), v.float(), tables, seq)
                # decode: every row one token
                q = torch.randn(len(lens), hq, d, device=device).to(dtype)
                starts = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
                ref = reference_attention(q.float(), *ref_args, starts, d**-0.5, window, softcap)
                out = paged_decode_attention(q, k, v, tables, seq, d**-0.5, window, softcap)
                key = f"decode_{str(dtype)[6:]}"
                worst[key] = max(worst.get(key, 0.0), (out.float() - ref).abs().max().item())
                # extend: chunks after cached prefixes, whole prompts, decodes, in one step
                q = torch.randn(sum(q_lens), hq, d, device=device).to(dtype)
                cum = [0]
                for n in q_lens:
                    cum.append(cum[-1] + n)
                starts = torch.tensor(cum, dtype=torch.int32, device=device)
                ref = reference_attention(q.float(), *ref_args, starts, d**-0.5, window, softcap)
                out = paged_extend_attention(q, k, v, tables, seq, starts, d**-0.5, window, softcap)
                key = f"extend_{str(dtype)[6:]}"
                worst[key] = max(worst.get(key, 0.0), (out.float() - ref).abs().max().item())
    return worst


def check_kernels(run: Run) -> None:
    if run.rehearse:  # the interpreter is chosen when a kernel is defined: a fresh process
        here = str(REPO / "benchmarks")
        code = (
            f"import json, sys; sys.path.insert(0, {here!r}); from gpu_check import kernel_errors; "
            "print('ERRORS', json.dumps(kernel_errors('cpu', True)))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={**os.environ, "TRITON_INTERPRET": "1"},
            timeout=600,
            check=False,
        )
        line = next((x for x in out.stdout.splitlines() if x.startswith("ERRORS ")), None)
        if line is None:
            raise RuntimeError(out.stderr[-2000:])
        worst = json.loads(line[len("ERRORS ") :])
    else:
        worst = kernel_errors(run.device, False)
    limits = {"float32": 1e-3, "bfloat16": 3e-2}
    ok = all(err < limits[name.split("_")[1]] for name, err in worst.items())
    run.record("kernels", ok, {"max_abs_error": worst, "limits": limits})


def check_graph_replay(run: Run) -> None:
    from inferflow.runtimes.step_inputs import EngineRow

    if not run.cuda:
        run.record("cuda_graph_replay", None, {"skipped": "needs CUDA"})
        return
    engine = make_engine(run, tiny_checkpoint(run), "float32", max_num_seqs=8)
    runner = engine.model_executor.runner
    rows = [EngineRow(i, (7 + i,), 5 + i, True, (i,)) for i in range(5)]
    graphs = runner.graphs
    with_graphs = runner.forward(rows)
    runner.graphs = None
    without = runner.forward(rows)
    runner.graphs = graphs
    err = float(abs(with_graphs - without).max())
    run.record(
        "cuda_graph_replay",
        graphs is not None and err < 1e-4,
        {"graphs": graphs.num_graphs if graphs else 0, "max_abs_error": err},
    )


def chip(run: Run) -> tuple[str, float | None, float | None]:
    """(name, datasheet bytes/s, datasheet bf16 FLOP/s) of the device (None: unknown)."""
    if not run.cuda:
        return "cpu", None, None
    import torch

    name = torch.cuda.get_device_name(0)
    for key, (bw, flops) in CHIPS.items():  # the longer names first (dict order)
        if key in name:
            return name, bw, flops
    return name, None, None


def measured_copy_bandwidth(run: Run) -> float | None:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted): what the memory
    sustains in practice (None on the CPU)."""
    if not run.cuda:
        return None
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    run.sync()
    start, n = time.perf_counter(), 20
    for _ in range(n):
        dst.copy_(src)
    run.sync()
    del src, dst
    return 2 * (1 << 30) * n / (time.perf_counter() - start)


def big_checkpoint(run: Run) -> Path:
    from inferflow.models.tiny import make_checkpoint

    path = run.work / "llama-1b"
    if not (path / "config.json").exists():
        make_checkpoint(path, spec_1b(run.rehearse), seed=0, dtype="bfloat16")
    return path


def check_decode(run: Run) -> None:
    from inferflow.models.checkpoint import load_checkpoint
    from inferflow.runtimes.step_inputs import EngineRow

    path = big_checkpoint(run)
    cfg = load_checkpoint(path).config
    dtype, batches = ("float32", (1, 4)) if run.rehearse else ("bfloat16", (1, 32, 128))
    itemsize = 4 if dtype == "float32" else 2
    engine = make_engine(
        run,
        path,
        dtype,
        max_num_seqs=max(batches),
        num_blocks=max(batches) * 16 + 8,
        max_model_len=256,
    )
    runner = engine.model_executor.runner
    name, bandwidth, _ = chip(run)
    copy_bw = measured_copy_bandwidth(run)
    params = cfg.num_parameters
    embed = cfg.vocab_size * cfg.hidden_size
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    position = 64  # each row decodes at position 64: it reads 65 positions of KV
    figures: dict[str, Any] = {
        "model_parameters": params,
        "dtype": dtype,
        "chip": name,
        "datasheet_bandwidth_bytes_s": bandwidth,
        "measured_copy_bandwidth_bytes_s": copy_bw,
    }
    steps = 5 if run.rehearse else 50
    for batch in batches:
        rows = [
            EngineRow(i, (5,), position, True, tuple(range(i * 16, i * 16 + 16)))
            for i in range(batch)
        ]
        for _ in range(3):
            runner.forward(rows)
        run.sync()
        start = time.perf_counter()
        for _ in range(steps):
            runner.forward(rows)
        run.sync()
        step_s = (time.perf_counter() - start) / steps
        # bytes one step reads: every weight once (the embedding table: the batch's rows only)
        # and each row's KV
        step_bytes = (params - embed + batch * cfg.hidden_size) * itemsize + batch * (
            position + 1
        ) * kv_per_token
        entry: dict[str, Any] = {
            "tok_s": round(batch / step_s, 1),
            "step_ms": round(step_s * 1e3, 3),
            "bytes_per_step": step_bytes,
            "achieved_bytes_s": round(step_bytes / step_s),
        }
        if bandwidth:
            entry["fraction_of_datasheet_bandwidth"] = round(step_bytes / step_s / bandwidth, 3)
        if copy_bw:
            entry["fraction_of_measured_copy_bandwidth"] = round(step_bytes / step_s / copy_bw, 3)
        figures[f"batch_{batch}"] = entry
    frac = figures[f"batch_{batches[0]}"].get("fraction_of_datasheet_bandwidth")
    # the bar: batch-1 decode reads at >= 50 % of the chip's bandwidth (reported, and
    # failed below it on a known chip; the rehearsal has no bar)
    run.record("decode", frac is None or frac >= 0.5, figures)


def check_prefill(run: Run) -> None:
    from inferflow.models.checkpoint import load_checkpoint
    from inferflow.runtimes.step_inputs import EngineRow

    path = big_checkpoint(run)
    cfg = load_checkpoint(path).config
    rows_n, chunk = (2, 16) if run.rehearse else (8, 512)
    dtype = "float32" if run.rehearse else "bfloat16"
    blocks = -(-chunk // 16)
    engine = make_engine(
        run,
        path,
        dtype,
        max_num_seqs=rows_n,
        num_blocks=rows_n * blocks + 8,
        max_model_len=chunk + 16,
        graphs=False,
    )
    runner = engine.model_executor.runner
    rows = [
        EngineRow(
            i,
            tuple((7 * i + j) % cfg.vocab_size for j in range(chunk)),
            0,
            True,
            tuple(range(i * blocks, (i + 1) * blocks)),
        )
        for i in range(rows_n)
    ]
    runner.forward(rows)
    run.sync()
    steps = 2 if run.rehearse else 10
    start = time.perf_counter()
    for _ in range(steps):
        runner.forward(rows)
    run.sync()
    step_s = (time.perf_counter() - start) / steps
    tokens = rows_n * chunk
    linear = 2 * (cfg.num_parameters - cfg.vocab_size * cfg.hidden_size) * tokens
    # causal attention: q.k and p.v, 2 FLOPs per product, ~chunk/2 keys per query on average
    attention = (
        2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * rows_n * chunk * (chunk + 1) / 2
    )
    tflops = (linear + attention) / step_s / 1e12
    name, _, peak = chip(run)
    figures: dict[str, Any] = {
        "rows": rows_n,
        "tokens_per_row": chunk,
        "step_ms": round(step_s * 1e3, 2),
        "tflop_s": float(f"{tflops:.4g}"),
        "chip": name,
        "datasheet_bf16_tflop_s": peak and peak / 1e12,
    }
    if peak:
        figures["fraction_of_datasheet"] = round(tflops * 1e12 / peak, 3)
    run.record("prefill", True, figures)


def check_serving(run: Run) -> None:
    from inferflow.bench.suite import free_port, managed_server, run_points
    from inferflow.models.tiny import SPEC_100M, make_checkpoint

    path = run.work / "served"
    if not (path / "config.json").exists():
        make_checkpoint(path, spec_1b(True) if run.rehearse else SPEC_100M, seed=0)
    port = free_port()
    concurrency, prompts = (4, 8) if run.rehearse else (32, 64)
    overrides = [
        "+model=local",
        f"model.path={path}",
        "executor=torch",
        f"executor.device={run.device}",
        f"executor.dtype={'float32' if run.rehearse else 'bfloat16'}",
        f"executor.compile={'eager' if run.rehearse else 'inductor'}",
        f"executor.cache_dir={run.work / 'engines'}",
        f"server.port={port}",
        "tracing=off",
        "batching.max_num_seqs=64",
    ]
    out_dir = run.work / "serve"
    env = {"INFERFLOW_HOME": str(run.work / "home")}
    with managed_server(
        [sys.executable, "-m", "inferflow", *overrides],
        port,
        out_dir / "server.log",
        timeout=240,
        env=env,
    ) as url:
        notes = run_points(
            url,
            "gpu-torch",
            [concurrency],
            [
                "--model",
                path.name,
                "--dataset-name",
                "random",
                "--random-input-len",
                "32" if run.rehearse else "128",
                "--random-output-len",
                "16" if run.rehearse else "64",
                "--num-prompts",
                str(prompts),
                "--num-warmups",
                "2",
            ],
            out_dir,
        )
    result = json.loads((out_dir / f"gpu-torch-c{concurrency}.json").read_text())
    run.record(
        f"serving_c{concurrency}",
        not notes and result.get("failed", 1) == 0,
        {
            k: result.get(k)
            for k in (
                "completed",
                "failed",
                "output_throughput",
                "median_ttft_ms",
                "median_tpot_ms",
            )
        },
    )


# (check, seconds it may need on a GPU): a check is skipped when less than that is left
CHECKS: list[tuple[Callable[[Run], None], float]] = [
    (check_kernels, 30),
    (check_parity, 40),
    (check_graph_replay, 30),
    (check_decode, 150),
    (check_prefill, 60),
    (check_serving, 120),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rehearse", action="store_true", help="the same path on the CPU, tiny sizes")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    ap.add_argument("--out", type=Path, default=None, help="the JSON written")
    args = ap.parse_args(argv)
    import torch

    device = "cpu" if args.rehearse else "cuda"
    results: dict[str, Any] = {
        "device": "cpu (rehearsal)" if args.rehearse else None,
        "checks": {},
        "torch": torch.__version__,
    }
    if not args.rehearse:
        if not torch.cuda.is_available():
            print("no CUDA device: torch", torch.__version__, "CUDA", torch.version.cuda)
            return 2
        results["device"] = torch.cuda.get_device_name(0)
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="inferflow-gpu-check-"))
    run = Run(device, args.rehearse, work, start + args.budget, results)
    print("device:", results["device"], "torch", torch.__version__, flush=True)
    for check, needs in CHECKS:
        name = check.__name__.removeprefix("check_")
        if not args.rehearse and run.left() < needs:
            run.record(
                name,
                None,
                {"skipped": f"{run.left():.0f} s left of the budget, needs ~{needs:.0f}"},
            )
            continue
        began = time.perf_counter()
        try:
            check(run)
        except Exception as exc:  # one failing check must not hide the others' results
            traceback.print_exc()
            run.record(name, False, {"error": repr(exc)})
        results.setdefault("check_seconds", {})[name] = round(time.perf_counter() - began, 1)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    out = (
        args.out
        or Path(os.environ.get("OUT") or REPO / "benchmarks" / "results") / "gpu_check.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out} in {results['wall_s']} s")
    return 0 if all(c["ok"] is not False for c in results["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
