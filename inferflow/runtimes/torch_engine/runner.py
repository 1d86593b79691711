"""The torch compiled engine: ``TorchLlama`` over a paged KV pool, compiled by Inductor, decode
steps replayed from CUDA graphs on CUDA.

- **Compilation** (``compile=inductor``): ``torch.compile(model, dynamic=True, fullgraph=True)``
  (with Inductor's ``freezing`` on CPU: weights folded in and prepacked for oneDNN);
  the paged attention is a custom op, so the whole decoder is one graph with symbolic token, row
  and block-table sizes. Padding (``step_batch.py``) keeps every size >= 2 and duck sizing is off,
  so one graph serves every mixed step and one every decode-only step; both are compiled at load
  (a warm-up), not on the first request. Inductor's caches (FX graph, AOTAutograd, Triton kernels)
  live in the engine's folder under ``compiled_engines/`` (``engine_dir.py``): a second start
  with the same key reuses them instead of compiling again.
- **CUDA graphs** (CUDA, ``cuda_graphs=true``): a decode-only step of B rows is padded to the
  next bucket (1, 2, 4, 8, ... up to ``max_num_seqs``) and replayed from a graph captured at
  load over static input buffers; mixed steps run the compiled graph directly.
- **Multi-LoRA** (``lora=LoraSpec``): the model holds zeroed per-layer, per-target slot stacks
  (``TorchLlama.lora_weights``, inputs of the compiled graph, so ``set_lora`` writes them in
  place: no recompile, no re-capture); each step's batch carries the ``lora_mask`` built from the
  rows' ``EngineRow.lora_slot`` and the slots' scalings this runner remembers. Each captured
  decode graph has its own static mask, filled per replay like its other inputs.
- **Memory**: the pool is ``layout.num_blocks`` blocks (``executor.kv_cache_memory`` decided how
  many) plus one scratch block; no slots, nothing per sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from inferflow.json_types import JSONObject
from inferflow.lora.adapter import LoraAdapter, LoraSpec
from inferflow.models.checkpoint import Checkpoint
from inferflow.runtimes.build_progress import BuildProgress, reset_peak_rss
from inferflow.runtimes.config import TorchSettings
from inferflow.runtimes.step_inputs import EngineRow
from inferflow.runtimes.torch_engine.engine_dir import TorchEngineDir, open_engine_dir
from inferflow.runtimes.torch_engine.model import DTYPES, TorchLlama
from inferflow.runtimes.torch_engine.step_batch import LoraScales, StepBatch, build_step_batch
from inferflow.scheduling.layout import KVLayout

log = logging.getLogger(__name__)


def graph_buckets(max_rows: int) -> list[int]:
    """Decode batch sizes a CUDA graph is captured for: powers of two, then ``max_rows``."""
    buckets, b = [], 1
    while b < max_rows:
        buckets.append(b)
        b *= 2
    return [*buckets, max_rows]


class CudaGraphDecoder:
    """Captured decode graphs, one per bucket, over static input buffers (shapes fixed)."""

    def __init__(self, forward: Callable[..., torch.Tensor], buckets: Sequence[int],
                 table_width: int, block_size: int, scratch_block: int,
                 device: torch.device, lora: LoraScales | None = None) -> None:
        self.buckets = sorted(buckets)
        self.table_width = table_width
        self.block_size, self.scratch_block = block_size, scratch_block
        self.lora = lora  # with LoRA the mask is one more static input of every bucket
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepBatch, torch.Tensor]] = {}
        pool = None
        for bucket in reversed(self.buckets):  # largest first: smaller ones reuse its memory
            static = self._pad([], bucket).to(device)
            forward(*static.forward_args())  # warm (allocations, autotuning) before capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(*static.forward_args())
            pool = graph.pool()
            self._graphs[bucket] = (graph, static, out)

    def _pad(self, rows: Sequence[EngineRow], bucket: int) -> StepBatch:
        # bucket + 2 rows in all, whatever the real count (padding rows keep every size >= 2)
        return build_step_batch(rows, self.block_size, self.scratch_block,
                                pad_rows=bucket + 2, table_width=self.table_width, lora=self.lora)

    def bucket_for(self, num_rows: int) -> int | None:
        return next((b for b in self.buckets if b >= num_rows), None)

    def run(self, rows: Sequence[EngineRow]) -> torch.Tensor | None:
        """Logits of a decode-only step from its bucket's graph; None if no bucket fits."""
        bucket = self.bucket_for(len(rows))
        if bucket is None:
            return None
        graph, static, out = self._graphs[bucket]
        batch = self._pad(rows, bucket)
        for name, value in vars(batch).items():
            if isinstance(value, torch.Tensor):
                getattr(static, name).copy_(value, non_blocking=True)
        graph.replay()
        return out[: batch.num_sampled]

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)


class TorchRunner:
    """Runs steps of rows (prefill chunks and decode tokens mixed) over the paged KV pool; with
    ``lora`` rows of different adapters (``EngineRow.lora_slot``) and the base model mix in one
    step (the ``LoraRunner`` of ``inferflow.lora``: ``lora_spec``, ``set_lora``)."""

    def __init__(self, checkpoint: Checkpoint, settings: TorchSettings, layout: KVLayout,
                 lora: LoraSpec | None = None) -> None:
        if not layout.paged:
            raise ValueError("executor=torch needs a paged KV layout (KVLayout.paged)")
        cfg = checkpoint.config
        cfg.check_context(checkpoint.path / "config.json",
                          min(layout.max_model_len, cfg.max_position_embeddings), "max_model_len")
        self.model_config, self.settings, self.layout = cfg, settings, layout
        self.device = torch.device(settings.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("executor.device=cuda: torch sees no CUDA device "
                               f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
        if settings.threads and self.device.type == "cpu":
            torch.set_num_threads(settings.threads)
        self.lora_spec = lora
        self.engine_dir: TorchEngineDir = open_engine_dir(checkpoint, settings, self.device, lora)
        started = time.perf_counter()
        max_positions = min(cfg.max_position_embeddings, layout.max_model_len)
        # tensor by tensor onto the device: float16 stays float16, bf16 is widened one tensor at
        # a time (numpy has no bfloat16), never the whole checkpoint
        read_as = np.float16 if settings.dtype == "float16" else np.float32
        label = f"loading {checkpoint.name} onto {self.device} as {settings.dtype}"
        reset_peak_rss()  # the progress's closing line then reports this load's peak
        with checkpoint.open_weights(read_as) as weights, BuildProgress.of(weights, label), \
                torch.inference_mode():
            self.model = TorchLlama(cfg, weights, layout.num_blocks, layout.block_size,
                                    max_positions, DTYPES[settings.dtype], self.device,
                                    lora).eval()
        # with LoRA: each slot's scaling (0: empty), read when a step's mask is built
        self._lora: LoraScales | None = None
        if lora is not None:
            self._lora = LoraScales(np.zeros(lora.max_loras, np.float32), lora.max_lora_rank,
                                    DTYPES[settings.dtype])
        self._forward: Callable[..., torch.Tensor] = self.model
        if settings.compile == "inductor":
            self._forward = self._compiled()
        # the model's forward over a batch's forward_args (with LoRA: the slot stacks appended)
        self._step: Callable[..., torch.Tensor] = (
            self._forward if lora is None else self._forward_with_lora)
        self.graphs: CudaGraphDecoder | None = None
        self._warm_up()
        if self.device.type == "cuda" and settings.cuda_graphs:
            with torch.inference_mode():
                self.graphs = CudaGraphDecoder(
                    self._step, graph_buckets(layout.max_slots), layout.max_blocks_per_seq,
                    layout.block_size, self.model.scratch_block, self.device, self._lora)
        self.engine_dir.commit()
        self.load_s = time.perf_counter() - started
        log.info("torch engine ready in %.1f s (%s, %s, %s, %d KV blocks = %.1f MiB%s)",
                 self.load_s, self.device, settings.dtype, settings.compile, layout.num_blocks,
                 self.model.kv_cache_bytes / 2**20,
                 f", {self.graphs.num_graphs} CUDA graphs" if self.graphs else "")

    def _compiled(self) -> Callable[..., torch.Tensor]:
        import torch.fx.experimental._config as fx_config

        self.engine_dir.use_for_compiler_caches()
        # distinct symbols for token, row and sampled counts even when equal in the warm-up
        fx_config.use_duck_shape = False
        # CPU: freezing folds the weights in as constants, so Inductor prepacks them for oneDNN's
        # matmuls (measured on the ~100M model, 2 cores, same minute: a batch-1 decode step 57 -> 30 ms); the
        # engine folder's key has the weights' digest, so frozen artifacts are never reused for
        # other weights
        options: dict[str, Any] = {"freezing": self.device.type == "cpu"}
        return torch.compile(self.model, dynamic=True, fullgraph=True,  # type: ignore[return-value]
                             options=options)

    def _forward_with_lora(self, *args: object) -> torch.Tensor:
        return self._forward(*args, self.model.lora_weights)

    def set_lora(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write ``adapter``'s A/B into ``slot`` (0 <= slot < S) in place, zero-padded to the
        slot rank, and remember its scaling; None clears the slot. The stacks keep their
        storage: no recompile, captured CUDA graphs stay valid. A (layer, target) the adapter
        does not train stays zero. Raises ValueError for an adapter that does not fit (a
        target or layer outside the engine's, a rank above ``max_lora_rank``, a shape unlike
        the base model's); the slot is then left empty."""
        spec, scales = self.lora_spec, self._lora
        if spec is None or scales is None:
            raise ValueError("set_lora: this torch engine was built without LoRA (lora_spec None)")
        if not 0 <= slot < spec.max_loras:
            raise ValueError(f"set_lora: slot {slot} outside [0, {spec.max_loras})")
        rank = spec.max_lora_rank
        cols = slice(slot * rank, (slot + 1) * rank)
        with torch.inference_mode():  # the stacks are inference tensors (made under it)
            scales.scaling[slot] = 0.0  # (a step between here and the end sees an empty slot)
            for a_all, b_all in self.model.lora_slots.values():
                a_all[:, cols].zero_()
                b_all[cols].zero_()
            if adapter is None:
                return
            if adapter.rank > rank:
                raise ValueError(f"set_lora: adapter {adapter.name!r} has rank {adapter.rank} > "
                                 f"max_lora_rank {rank}")
            staged = []
            for (layer, target), (a, b) in sorted(adapter.weights.items()):
                stacks = self.model.lora_slots.get((layer, target))
                if stacks is None:
                    raise ValueError(f"set_lora: adapter {adapter.name!r} trains {target} of "
                                     f"layer {layer}, which this engine has no LoRA slot for "
                                     f"(targets {', '.join(spec.targets)})")
                a_all, b_all = stacks
                r = a.shape[1] if a.ndim == 2 else -1
                if a.shape != (a_all.shape[0], r) or b.shape != (r, b_all.shape[1]) or r > rank:
                    raise ValueError(f"set_lora: adapter {adapter.name!r}, layer {layer} "
                                     f"{target}: A {a.shape}, B {b.shape} do not fit "
                                     f"({a_all.shape[0]}, r <= {rank}), (r, {b_all.shape[1]})")
                staged.append((a_all, b_all, a, b, r))
            for a_all, b_all, a, b, r in staged:
                start = slot * rank
                a_all[:, start:start + r].copy_(torch.from_numpy(np.ascontiguousarray(a)))
                b_all[start:start + r].copy_(torch.from_numpy(np.ascontiguousarray(b)))
            scales.scaling[slot] = adapter.scaling

    def _warm_up(self) -> None:
        """Compile (or load from the cache) the mixed-step and decode-step graphs now."""
        scratch = (self.model.scratch_block,)
        with torch.inference_mode():
            self.forward([EngineRow(0, (0, 0), 0, True, scratch)])  # a prefill chunk
            self.forward([EngineRow(0, (0,), 0, True, scratch)])  # decode only

    def forward(self, rows: Sequence[EngineRow]) -> np.ndarray:
        """(R, V) float32 logits: each row's ``logits_count`` rows, in row order."""
        with torch.inference_mode():
            logits = None
            # a bucket's graph returns one logits row per row: decode rows only
            if self.graphs is not None and all(len(r.token_ids) == 1 == r.logits_count
                                               for r in rows):
                logits = self.graphs.run(rows)
            if logits is None:
                batch = build_step_batch(rows, self.layout.block_size, self.model.scratch_block,
                                         lora=self._lora)
                if self.device.type != "cpu":
                    batch = batch.to(self.device)
                logits = self._step(*batch.forward_args())[: batch.num_sampled]
            return logits.cpu().numpy()

    def describe(self) -> JSONObject:
        return {
            "device": str(self.device),
            "device_name": self.engine_dir.fields.get("device_arch"),
            "dtype": self.settings.dtype,
            "compile": self.settings.compile,
            "cuda_graphs": self.graphs.num_graphs if self.graphs else 0,
            "kv_blocks": self.layout.num_blocks,
            "kv_cache_bytes": self.model.kv_cache_bytes,
            "load_s": round(self.load_s, 2),
            "compiled_engine_reused": self.engine_dir.reused,
            **({} if self.lora_spec is None else {
                "lora_max_loras": self.lora_spec.max_loras,
                "lora_max_rank": self.lora_spec.max_lora_rank,
                "lora_targets": list(self.lora_spec.targets)}),
        }

