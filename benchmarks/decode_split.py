#!/usr/bin/env python
"""What a decode step costs with its attention outside ONNX Runtime, against the engine's call.

    python benchmarks/decode_split.py                       # ~100M: 1 and 32 rows at context 320
    python benchmarks/decode_split.py --rows 8,32 --contexts 128,320,1000 --rounds 5

The engine runs a decode step as one ONNX Runtime call whose GroupQueryAttention reads each KV
head once per query head of its group (~40 % of a 32-row call at ~100M:
``engine_profile.py``). ``SplitDecoder`` runs the same weights cut at every attention
(``build_llama_segments``: L + 1 ONNX Runtime calls) and, between them, the C++ kernel's
``decode_layer`` (``kernels/decode_attention.cpp``): rotary, the KV write into the engine's own
slot buffers, and an attention that reads each KV head once for its whole group. Both get the
same rows (one new token each, in slots 0..rows-1, every slot at ``context`` tokens) on the same
KV; the split step's logits are checked against the engine's first. Rounds alternate the two
(this VM drifts). The split step holds the weights twice (the engine's session and the
segments'): it measures the route, it does not serve (docs/performance.md has why it is not
kept: its gain did not survive the server).

Writes ``benchmarks/results/decode_split-<model>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.decode_attention_kernel import build  # noqa: E402
from benchmarks.engine_profile import wall_ms  # noqa: E402
from benchmarks.peers import MODELS, add_path_args, checkpoint  # noqa: E402
from inferflow.models.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from inferflow.models.llama_graph import GraphSpec, build_llama_segments  # noqa: E402
from inferflow.models.rope import cos_sin_cache  # noqa: E402
from inferflow.runtimes.config import OrtSettings  # noqa: E402
from inferflow.runtimes.onnxruntime_runner import OnnxRuntimeRunner  # noqa: E402
from inferflow.runtimes.step_inputs import EngineRow  # noqa: E402
from inferflow.scheduling.layout import KVLayout  # noqa: E402


class SplitDecoder:
    """Decode steps over the engine's slot KV buffers: ``kv[layer] = (K, V)``, each
    (slots, Hkv, capacity, D) float32, written and read in place."""

    def __init__(self, checkpoint: Checkpoint, spec: GraphSpec, options: ort.SessionOptions,
                 kv: Sequence[tuple[np.ndarray, np.ndarray]], library: ctypes.CDLL) -> None:
        cfg = self.model_config = checkpoint.config
        self.kv, self.library, self.capacity = kv, library, spec.max_model_len
        with checkpoint.open_weights(np.float32) as weights:  # one segment's weights at a time
            self.segments = [ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                             for m in build_llama_segments(cfg, weights, spec)]
        self.cos, self.sin = cos_sin_cache(cfg.rope, cfg.head_dim, self.capacity)

    def forward(self, rows: Sequence[EngineRow]) -> np.ndarray:
        """(len(rows), V) logits, in row order; each row's K and V written at its position."""
        cfg, n = self.model_config, len(rows)
        tokens = np.fromiter((r.token_ids[0] for r in rows), np.int64, n)
        slots = np.fromiter((r.slot for r in rows), np.int64, n)
        positions = np.fromiter((r.start_pos for r in rows), np.int32, n)
        q = np.empty((n, cfg.num_heads * cfg.head_dim), np.float32)  # the kernel's rotated queries
        attn = np.empty_like(q)
        x, qkv = self.segments[0].run(None, {"input_ids": tokens})
        for i, (k, v) in enumerate(self.kv):
            self.library.decode_layer(qkv.ctypes.data, slots.ctypes.data, positions.ctypes.data,
                                      self.cos.ctypes.data, self.sin.ctypes.data, k.ctypes.data,
                                      v.ctypes.data, n, cfg.num_heads, cfg.num_kv_heads, self.capacity,
                                      cfg.head_dim, q.ctypes.data, attn.ctypes.data)
            if i + 1 < cfg.num_layers:
                x, qkv = self.segments[i + 1].run(None, {"x": x, "attn": attn})
        feeds = {"x": x, "attn": attn, "logits_index": np.arange(n, dtype=np.int64)}
        return self.segments[-1].run(None, feeds)[0]


def max_logit_error(runner: OnnxRuntimeRunner, split: SplitDecoder, rng: np.random.Generator) -> float:
    """Prefill a few slots (uneven lengths, one slot skipped), then the same decode step twice:
    the engine's call, then the split step rewriting the same KV positions."""
    vocab, slots = runner.model_config.vocab_size, np.array([0, 2, 3])
    lengths = np.array([9, 33, 20])
    runner.forward([EngineRow(int(s), tuple(int(t) for t in rng.integers(vocab, size=int(n))), 0, False)
                    for s, n in zip(slots, lengths, strict=True)])
    tokens = rng.integers(vocab, size=len(slots))
    want = runner.forward([EngineRow(int(s), (int(t),), int(n), True)
                           for s, t, n in zip(slots, tokens, lengths, strict=True)])
    got = split.forward([EngineRow(int(s), (int(t),), int(n), True) for s, t, n in zip(slots, tokens, lengths, strict=True)])
    return float(np.abs(got - want).max())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="100m", choices=sorted(MODELS))
    p.add_argument("--checkpoint", type=Path, help="a Llama checkpoint instead of --model's seeded one")
    p.add_argument("--rows", default="1,32", help="decode rows per step, comma-separated")
    p.add_argument("--contexts", default="320", help="tokens in every slot, comma-separated")
    p.add_argument("--repeats", type=int, default=10, help="steps per measurement (median)")
    p.add_argument("--rounds", type=int, default=4)
    add_path_args(p, REPO / "benchmarks" / "results", peers=False)
    args = p.parse_args()
    rows_list = [int(x) for x in args.rows.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    path = args.checkpoint or checkpoint(args.model, args.models_dir)
    name = path.name if args.checkpoint else args.model
    ck = load_checkpoint(path)
    runner = OnnxRuntimeRunner(ck, OrtSettings(), KVLayout.plan(max(*rows_list, 4), 2048))
    while not runner.kv_resident:
        time.sleep(0.1)
    rng = np.random.default_rng(0)
    # the kernel's OpenMP threads sleep when a call returns (read when libgomp loads): spinning,
    # they took a core from the next segment's call (the segments ran ~50 % longer)
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    with tempfile.TemporaryDirectory() as folder:
        split = SplitDecoder(ck, runner.spec, runner.session_options(), runner.kv, build(Path(folder)))
        error = max_logit_error(runner, split, rng)
        if error > 1e-3:
            sys.exit(f"the split step disagrees with the engine: max abs logit error {error:.3g}")
        runs = []
        print("| round | rows | context | engine ms | split ms | ratio |\n|---|---|---|---|---|---|")
        for rnd in range(1, args.rounds + 1):
            for b in rows_list:
                for context in contexts:
                    engine_ms, split_ms = measure(runner, split, b, context, args.repeats, rng, rnd % 2 == 0)
                    run = {"round": rnd, "rows": b, "context": context, "engine_ms": round(engine_ms, 2),
                           "split_ms": round(split_ms, 2), "ratio": round(engine_ms / split_ms, 3)}
                    runs.append(run)
                    print(f"| {rnd} | {b} | {context} | {run['engine_ms']} | {run['split_ms']} | {run['ratio']} |",
                          flush=True)
    summary = {f"{b}x{c}": {key: round(statistics.median(r[key] for r in runs if (r["rows"], r["context"]) == (b, c)), 3)
                            for key in ("engine_ms", "split_ms", "ratio")}
               for b in rows_list for c in contexts}
    for point, s in summary.items():
        print(f"{point}: engine {s['engine_ms']} ms, split {s['split_ms']} ms (median ratio {s['ratio']})")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"decode_split-{name}.json"
    out.write_text(json.dumps({"model": name, "onnxruntime": ort.__version__, "max_logit_error": error,
                               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "runs": runs,
                               "summary": summary}, indent=2) + "\n")
    print(f"results written to {out}")
    return 0


def measure(runner: OnnxRuntimeRunner, split: SplitDecoder, rows: int, context: int, repeats: int,
            rng: np.random.Generator, split_first: bool) -> tuple[float, float]:
    """Median ms of the engine's step and of the split step: ``rows`` new tokens at ``context``."""
    vocab = runner.model_config.vocab_size

    def step() -> list[EngineRow]:
        return [EngineRow(s, (int(t),), context, True) for s, t in enumerate(rng.integers(vocab, size=rows))]

    def engine_step() -> None:
        runner.forward(step())

    def split_step() -> None:
        split.forward(step())

    if split_first:
        split_ms = wall_ms(split_step, repeats)
        return wall_ms(engine_step, repeats), split_ms
    engine_ms = wall_ms(engine_step, repeats)
    return engine_ms, wall_ms(split_step, repeats)


if __name__ == "__main__":
    sys.exit(main())
