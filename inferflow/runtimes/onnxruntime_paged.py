"""ONNX Runtime engine over a paged KV pool (``graph_form=paged``, the CPU default).

Memory, per layer: K and V pools ``(num_blocks + 1, Hkv, block_size, D)``, the engine's only KV
(``KVLayout.paged``): the scheduler's block ids are the pool's blocks, a prefix hit shares blocks
by refcount, nothing is copied, and a sequence holds only the blocks its tokens fill. Block
``num_blocks`` is the null block: a block-table entry the scheduler freed under a sliding window
points at it, and the op never reads it unmasked. The pool is made resident while the engine
loads, so the first steps after ``/ready`` run at full speed.

One IOBinding for the engine's life: each layer's pool is bound as ``key_cache_{i}`` and as
``present_key_{i}`` (the same memory: ``inferflow::PagedAttention`` writes the step's K/V in
place); a step rebinds only its small inputs and the logits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from inferflow.models.checkpoint import Checkpoint
from inferflow.runtimes.config import OrtSettings
from inferflow.runtimes.kv_memory import check_fits, kv_buffer, populate
from inferflow.runtimes.onnxruntime_runner import OrtEngine
from inferflow.runtimes.step_inputs import EngineRow, build_paged_arrays
from inferflow.scheduling.layout import KVLayout

if TYPE_CHECKING:
    from inferflow.lora.adapter import LoraSpec

log = logging.getLogger(__name__)


class PagedOnnxRuntimeRunner(OrtEngine):
    """Runs steps of rows (prefill chunks and decode tokens mixed, one call) over the paged pool."""

    def __init__(self, checkpoint: Checkpoint, settings: OrtSettings, layout: KVLayout,
                 lora: LoraSpec | None = None) -> None:
        if not layout.paged:
            raise ValueError("graph_form=paged needs a paged KV layout (KVLayout.paged)")
        if settings.graph_form != "paged":
            raise ValueError(f"graph_form={settings.graph_form} runs on slots: OnnxRuntimeRunner")
        super().__init__(checkpoint, settings, layout, lora)
        cfg = self.model_config
        dtype = self.spec.act_dtype
        self.null_block = layout.num_blocks  # the scheduler's null block; also padding's scratch
        shape = (layout.num_blocks + 1, cfg.num_kv_heads, layout.block_size, cfg.head_dim)
        check_fits(2 * cfg.num_layers * int(np.prod(shape)) * dtype.itemsize)
        self.pool = [(kv_buffer(shape, dtype), kv_buffer(shape, dtype)) for _ in range(cfg.num_layers)]
        started = time.perf_counter()
        resident = populate([buf for layer in self.pool for buf in layer])  # before /ready
        self.kv_cache_bytes = sum(buf.nbytes for layer in self.pool for buf in layer)
        log.info("paged KV pool: %d blocks of %d = %.1f MiB%s in %.2f s", layout.num_blocks,
                 layout.block_size, self.kv_cache_bytes / 2**20,
                 " made resident" if resident else "", time.perf_counter() - started)
        self._binding = self.session.io_binding()
        for i, (k, v) in enumerate(self.pool):
            for kind, buf in (("key", k), ("value", v)):
                args = ("cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
                self._binding.bind_input(f"{kind}_cache_{i}", *args)
                self._binding.bind_output(f"present_{kind}_{i}", *args)  # same memory: in place
        if self.lora_slots is not None:  # the adapter slots, once (set_lora writes in place)
            self.lora_slots.bind(self._binding)

    @property
    def kv_resident(self) -> bool:
        """Always: the pool is made resident while the engine loads."""
        return True

    def forward(self, rows: Sequence[EngineRow]) -> np.ndarray:
        """Compute the rows' KV into their blocks; return (R, V) logits: each row's
        ``logits_count`` rows, in row order."""
        for r in rows:
            if not r.token_ids or r.start_pos + len(r.token_ids) > self.capacity \
                    or r.logits_count > len(r.token_ids):
                raise ValueError(f"row does not fit the engine: start {r.start_pos}, "
                                 f"{len(r.token_ids)} tokens, capacity {self.capacity}")
        a = build_paged_arrays(rows, self.layout.block_size, self.null_block)
        feeds = {"input_ids": a.input_ids, "positions": a.positions, "slot_mapping": a.slot_mapping,
                 "block_tables": a.block_tables, "seq_lens": a.seq_lens,
                 "query_start": a.query_start, "logits_index": a.logits_index,
                 **self.lora_feeds(rows, len(a.input_ids))}
        return self.run_bound(self._binding, feeds, len(a.logits_index))

    def describe(self) -> dict[str, object]:
        return {"kv_layout": "paged", "kv_blocks": self.layout.num_blocks,
                "kv_cache_bytes": self.kv_cache_bytes}
