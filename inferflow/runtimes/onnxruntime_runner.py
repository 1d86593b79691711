"""ONNX Runtime engine: the compiled graph plus slot KV buffers, updated in place (the slot
layout, ``graph_form=gqa|canonical``; the paged pool is ``onnxruntime_paged``).

Memory, per layer: K and V slot buffers (max_slots, Hkv, C, D) where C = max_model_len, and a
block pool (num_blocks, Hkv, block_size, D) backing the prefix cache, all made resident when the
engine loads (``kv_memory.py``). The in-place (gqa) form binds the first B slots of each buffer
as both past and present through IOBinding, so a step writes only its new K/V; the canonical
form (the reference) gathers and scatters slots.

Sliding windows (Mistral, Qwen2/3, Gemma 2/3, Phi-3): a windowed layer's slot buffers are laid out
as any layer's, the whole context (C positions, each where it was written); the graph only hides
the keys outside the window (``models/graph_attention.py``). A window saves no KV memory here, and
prefill, chunked prefill across a window, decode and the prefix cache's block copies work as for
full attention.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort

from inferflow.models.checkpoint import Checkpoint
from inferflow.models.errors import CheckpointError
from inferflow.models.graph_attention import GQA_HEAD_MULTIPLE
from inferflow.models.llama_graph import GRAPH_BUILDER_VERSION, GraphSpec
from inferflow.runtimes.config import OrtSettings
from inferflow.runtimes.engine_cache import CacheEntry, get_or_build
from inferflow.runtimes.kv_memory import check_fits, kv_buffer, make_resident
from inferflow.runtimes.llama_build import build_llama_engine
from inferflow.runtimes.ort_lora import LoraSlotBuffers
from inferflow.runtimes.step_inputs import (
    EngineRow,
    StepArrays,
    build_step_arrays,
    merge_call_logits,
    split_calls,
    split_padding,
)
from inferflow.scheduling.layout import KVLayout
from inferflow.scheduling.plan import KVBlockCopy

if TYPE_CHECKING:
    from inferflow.lora.adapter import LoraAdapter, LoraSpec

log = logging.getLogger(__name__)

MAX_BINDINGS = 64  # slot windows whose IOBinding is kept (binding one is ~50 calls into ORT)


class OrtEngine:
    """What every ONNX Runtime engine shares: the checkpoint checked against the served context,
    the compiled graph (built once, cached in ``compiled_engines/``) and the session with its
    options. The KV memory and ``forward`` are the layout's (slots here, the paged pool in
    ``onnxruntime_paged``).

    With ``lora`` (multi-LoRA, issue 43) the graph takes the stacked adapter slots as inputs
    (``models/llama_graph``): the engine owns them (``ort_lora.LoraSlotBuffers``), binds them by
    pointer, fills them through :meth:`set_lora` (the ``LoraRunner`` protocol) and builds each
    call's ``lora_mask`` from its rows' ``lora_slot``. ``lora_spec`` is None without."""

    def __init__(self, checkpoint: Checkpoint, settings: OrtSettings, layout: KVLayout,
                 lora: LoraSpec | None = None) -> None:
        if lora is not None and settings.graph_form not in ("gqa", "paged"):
            raise ValueError(f"multi-LoRA needs graph_form gqa or paged, not {settings.graph_form}")
        cfg = checkpoint.config
        cfg.check_context(checkpoint.path / "config.json",
                          min(layout.max_model_len, cfg.max_position_embeddings), "max_model_len")
        if settings.graph_form == "gqa" and cfg.head_dim % GQA_HEAD_MULTIPLE:
            raise CheckpointError(checkpoint.path / "config.json", f"head_dim={cfg.head_dim}: the CPU "
                                  f"graph's GroupQueryAttention needs a multiple of {GQA_HEAD_MULTIPLE}; "
                                  "serve it with executor.graph_form=canonical")
        self.model_config, self.settings, self.layout = cfg, settings, layout
        self.capacity = min(layout.max_model_len, cfg.max_position_embeddings)
        self.spec = GraphSpec(settings.graph_form, settings.precision, self.capacity,  # type: ignore[arg-type]
                              settings.quant_block_size, settings.quant_accuracy_level, lora)
        self.lora_spec = lora
        self.cache_entry: CacheEntry = get_or_build(
            settings.engine_dir, self.cache_fields(checkpoint),
            lambda folder: build_llama_engine(checkpoint, self.spec, folder))
        self.session = ort.InferenceSession(str(self.cache_entry.model_path), self.session_options(),
                                            providers=["CPUExecutionProvider"])
        self.lora_slots = None if lora is None else \
            LoraSlotBuffers(self.session, lora, cfg, self.spec.act_dtype)

    def cache_fields(self, checkpoint: Checkpoint) -> dict[str, object]:
        return {"weights_digest": checkpoint.weights_digest, "builder_version": GRAPH_BUILDER_VERSION,
                "onnx_version": onnx.__version__, "onnxruntime_version": ort.__version__,
                "graph_form": self.spec.form, "precision": self.spec.precision,
                "max_model_len": self.capacity, "quant_block_size": self.spec.quant_block_size,
                "quant_accuracy_level": self.spec.quant_accuracy_level,
                "architecture": self.model_config.architecture,
                **(self.lora_spec.cache_fields() if self.lora_spec is not None else {})}

    def session_options(self) -> ort.SessionOptions:
        """The options every session of this engine runs with (threads, spinning, quantization,
        the paged form's custom op)."""
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = self.settings.intra_op_threads
        so.inter_op_num_threads = self.settings.inter_op_threads
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # spinning pool threads pick up each op of a call at once instead of being woken (a
        # ~25 % shorter decode call at batch 1 on 2 cores); force_spinning_stop ends the spin
        # when the call returns, so between calls (and in an idle server) nothing spins
        spin = "1" if self.settings.allow_spinning else "0"
        so.add_session_config_entry("session.intra_op.allow_spinning", spin)
        so.add_session_config_entry("session.inter_op.allow_spinning", spin)
        so.add_session_config_entry("session.force_spinning_stop", "1")
        so.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", str(self.spec.quant_accuracy_level))
        if self.spec.form == "paged":
            from inferflow.runtimes.ort_ops.build import paged_attention_library

            so.register_custom_ops_library(str(paged_attention_library()))
        so.log_severity_level = 3
        return so

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights in the compiled engine (its external-data file)."""
        files = self.cache_entry.manifest["files"]
        return int(sum(meta["size"] for name, meta in files.items() if name.endswith(".data")))

    def forward(self, rows: Sequence[EngineRow]) -> np.ndarray:
        """(R, V) float32 logits: each row's ``logits_count`` rows, in row order."""
        raise NotImplementedError

    def set_lora(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write ``adapter``'s A/B (zero-padded to the engine's rank) into LoRA ``slot`` in place
        and remember its scaling; None clears the slot. No rebuild, no rebinding."""
        if self.lora_slots is None:
            raise ValueError("this engine was built without LoRA (lora_spec None)")
        self.lora_slots.set(slot, adapter)

    def lora_feeds(self, rows: Sequence[EngineRow], num_tokens: int) -> dict[str, np.ndarray]:
        """``{"lora_mask": (num_tokens, S*R)}`` for a call packing ``rows`` (then padding), or
        nothing without LoRA (where a row naming a LoRA slot is refused)."""
        if self.lora_slots is None:
            if any(r.lora_slot >= 0 for r in rows):
                raise ValueError("a row has a lora_slot but this engine was built without LoRA")
            return {}
        return {"lora_mask": self.lora_slots.mask(rows, num_tokens)}

    def run_bound(self, binding: ort.IOBinding, feeds: dict[str, np.ndarray],
                  num_logits: int) -> np.ndarray:
        """One call on ``binding`` (its KV already bound) with ``feeds`` as the step's inputs;
        returns the (num_logits, V) float32 logits, written straight into a fresh array."""
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        logits = np.empty((num_logits, self.model_config.vocab_size), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits


class OnnxRuntimeRunner(OrtEngine):
    """Runs steps of rows (prefill chunks and decode tokens mixed) over slot KV buffers."""

    def __init__(self, checkpoint: Checkpoint, settings: OrtSettings, layout: KVLayout,
                 lora: LoraSpec | None = None) -> None:
        if settings.graph_form == "paged":
            raise ValueError("graph_form=paged runs on the paged pool: PagedOnnxRuntimeRunner")
        super().__init__(checkpoint, settings, layout, lora)
        cfg = self.model_config
        dtype = self.spec.act_dtype
        shape = (layout.max_slots, cfg.num_kv_heads, self.capacity, cfg.head_dim)
        pool = (layout.num_blocks, cfg.num_kv_heads, layout.block_size, cfg.head_dim)
        # kv[layer][0] is K, kv[layer][1] is V; checked against the machine's memory now, made
        # resident by a background thread, slot buffers first (kv_memory.py)
        check_fits(2 * cfg.num_layers * (int(np.prod(shape)) + int(np.prod(pool))) * dtype.itemsize)
        self.kv = [(kv_buffer(shape, dtype), kv_buffer(shape, dtype)) for _ in range(cfg.num_layers)]
        self.pool = [(kv_buffer(pool, dtype), kv_buffer(pool, dtype)) for _ in range(cfg.num_layers)]
        self._kv_populating = make_resident([buf for layer in (*self.kv, *self.pool) for buf in layer])
        self._bindings: dict[tuple[int, int], ort.IOBinding] = {}  # (first slot, batch) -> binding
        self._total_seq_len = np.array(self.capacity, np.int32)

    @property
    def kv_resident(self) -> bool:
        """True once every KV page is resident (the background population is done)."""
        return not self._kv_populating.is_alive()

    @property
    def num_slots(self) -> int:
        return self.layout.max_slots

    # --- prefix-cache block copies -------------------------------------------------------------
    # A step's copies move in one indexing operation per layer and kind, not one per block, layer
    # and kind (a burst of prefills saves hundreds of blocks at once): the slot buffer is viewed
    # as blocks, (slots, Hkv, C // bs, bs, D), so indexing it by (slot, block index) pairs gives
    # (n, Hkv, bs, D), the pool's own layout, copied in contiguous (bs, D) pieces.

    def _slot_blocks(self, buf: np.ndarray) -> np.ndarray:
        """``buf`` (slots, Hkv, C, D) as a view (slots, Hkv, C // bs, bs, D)."""
        slots, heads, capacity, dim = buf.shape
        bs = self.layout.block_size
        whole = capacity // bs * bs  # a block always lies inside the capacity
        return buf[:, :, :whole].reshape(slots, heads, whole // bs, bs, dim)

    @staticmethod
    def _block_index(copies: Sequence[KVBlockCopy]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slots, block indices, pool block ids) of ``copies``, each (n,)."""
        n = len(copies)
        return (np.fromiter((c.slot for c in copies), np.intp, n),
                np.fromiter((c.block_index for c in copies), np.intp, n),
                np.fromiter((c.block_id for c in copies), np.intp, n))

    def load_blocks(self, copies: Sequence[KVBlockCopy]) -> None:
        """Pool block -> slot positions (prefix-cache hit)."""
        if not copies:
            return
        slots, index, ids = self._block_index(copies)
        for layer, pool in zip(self.kv, self.pool, strict=True):
            for buf, blocks in zip(layer, pool, strict=True):
                self._slot_blocks(buf)[slots, :, index] = blocks[ids]

    def save_blocks(self, copies: Sequence[KVBlockCopy]) -> None:
        """Slot positions -> pool block (a block became full)."""
        if not copies:
            return
        slots, index, ids = self._block_index(copies)
        for layer, pool in zip(self.kv, self.pool, strict=True):
            for buf, blocks in zip(layer, pool, strict=True):
                blocks[ids] = self._slot_blocks(buf)[slots, :, index]

    # --- forward ---------------------------------------------------------------------------------
    def forward(self, rows: Sequence[EngineRow]) -> np.ndarray:
        """Compute the rows' KV in their slots; return (R, V) logits: each row's ``logits_count``
        rows, in row order."""
        for r in rows:
            if (not r.token_ids or r.start_pos + len(r.token_ids) > self.capacity
                    or not 0 <= r.slot < self.num_slots or r.logits_count > len(r.token_ids)):
                raise ValueError(f"row does not fit the engine: slot {r.slot}, start {r.start_pos}, "
                                 f"{len(r.token_ids)} tokens, capacity {self.capacity}")
        gqa = self.spec.form == "gqa"
        calls = split_calls(rows, self.capacity)
        if gqa:  # a window of slots per call: a lone prefill chunk is not padded to B rows
            calls = [part for call in calls for part in split_padding(rows, call)]
        results = []
        for call in calls:
            call_rows = [rows[i] for i in call]
            arrays = build_step_arrays(call_rows, slot_range=gqa, window=gqa)
            lora = self.lora_feeds(call_rows, len(arrays.input_ids))
            results.append(self._run_gqa(arrays, lora) if gqa else self._run_canonical(arrays))
        return merge_call_logits(rows, calls, results, self.model_config.vocab_size)

    def _binding(self, lo: int, batch: int) -> ort.IOBinding:
        """IOBinding for calls over slots [lo, lo + batch): KV views bound as past and present
        (the same memory), kept for the most recent windows."""
        binding = self._bindings.pop((lo, batch), None)
        if binding is None:
            binding = self.session.io_binding()
            for i, (k, v) in enumerate(self.kv):
                for kind, buf in (("key", k), ("value", v)):
                    view = buf[lo:lo + batch]  # (B, Hkv, C, D), contiguous: slots lead
                    args = ("cpu", 0, buf.dtype, list(view.shape), view.ctypes.data)
                    binding.bind_input(f"past_{kind}_{i}", *args)
                    binding.bind_output(f"present_{kind}_{i}", *args)  # same memory: in place
            if self.lora_slots is not None:
                self.lora_slots.bind(binding)
        self._bindings[(lo, batch)] = binding  # most recently used last
        while len(self._bindings) > MAX_BINDINGS:
            del self._bindings[next(iter(self._bindings))]
        return binding

    def _run_gqa(self, a: StepArrays, lora: dict[str, np.ndarray]) -> np.ndarray:
        binding = self._binding(int(a.slots[0]), len(a.slots))
        feeds = {"input_ids": a.input_ids, "pad_index": a.pad_index, "unpad_index": a.unpad_index,
                 "logits_index": a.logits_index, "seqlens_k": a.seqlens_k,
                 "total_seq_len": self._total_seq_len, "query_seqlens": a.query_seqlens, **lora}
        return self.run_bound(binding, feeds, len(a.logits_index))

    def _run_canonical(self, a: StepArrays) -> np.ndarray:
        feeds: dict[str, np.ndarray] = {
            "input_ids": a.input_ids, "pad_index": a.pad_index, "unpad_index": a.unpad_index,
            "logits_index": a.logits_index, "position_ids": a.position_ids, "write_indices": a.write_indices}
        for i, (k, v) in enumerate(self.kv):
            feeds[f"past_key_{i}"], feeds[f"past_value_{i}"] = k[a.slots], v[a.slots]
        outputs = self.session.run(None, feeds)
        for i, (k, v) in enumerate(self.kv):
            k[a.slots], v[a.slots] = outputs[1 + 2 * i], outputs[2 + 2 * i]
        return outputs[0]
