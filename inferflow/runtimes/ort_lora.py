"""The ONNX Runtime engines' multi-LoRA slots (issue 43; the graph side is ``models/llama_graph``).

An engine built with a ``LoraSpec`` (S = ``max_loras`` slots of rank R) has, per layer and target
projection, graph inputs ``lora_a_{t}_{i}`` (d_in, S*R) and ``lora_b_{t}_{i}`` (S*R, d_out) and
one ``lora_mask`` (N, S*R). :class:`LoraSlotBuffers` owns the A and B buffers (numpy, allocated
once at the shapes the session declares, zero), which the runners bind to their IOBindings by
pointer once: writing an adapter into a slot (:meth:`LoraSlotBuffers.set`) changes the next call's
result with no rebuild and no rebinding. Each call's mask comes from its rows' ``lora_slot``
(:meth:`LoraSlotBuffers.mask`).

Where the graph pads a projection (the MLP's ``_ffn_padding``: B of gate and up, A of down are
I + pad wide), an adapter fills the leading d_in rows of A and d_out columns of B; the rest stays
zero. A rank r < R fills the slot's first r columns (rows); the others stay zero, which is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from inferflow.models.config import ModelArch
from inferflow.runtimes.step_inputs import EngineRow

if TYPE_CHECKING:
    from inferflow.lora.adapter import LoraAdapter, LoraSpec


def projection_dims(cfg: ModelArch) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each LoRA target projection of ``cfg`` (PEFT's names), unpadded."""
    h, qw, kw = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    return {"q_proj": (h, qw), "k_proj": (h, kw), "v_proj": (h, kw), "o_proj": (qw, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


class LoraSlotBuffers:
    """The S stacked adapter slots of one engine and each slot's scaling.

    ``buffers[name]``: the array bound as graph input ``name`` (``lora_a_{t}_{i}`` or
    ``lora_b_{t}_{i}``); ``_scales`` (S + 1, S*R): row s is the mask row of a token of slot s
    (its scaling on the slot's R columns), the last row (index -1: the base model) is zero.
    """

    def __init__(self, session: ort.InferenceSession, spec: LoraSpec, cfg: ModelArch,
                 dtype: np.dtype) -> None:
        self.spec, self.dtype = spec, np.dtype(dtype)
        self.rank, self.width = spec.max_lora_rank, spec.max_loras * spec.max_lora_rank
        self.dims = projection_dims(cfg)
        self.buffers: dict[str, np.ndarray] = {}
        for arg in session.get_inputs():
            if arg.name.startswith(("lora_a_", "lora_b_")):
                self.buffers[arg.name] = np.zeros([int(d) for d in arg.shape], self.dtype)
        expected = 2 * cfg.num_layers * len(spec.targets)
        if len(self.buffers) != expected:
            raise ValueError(f"the engine's graph has {len(self.buffers)} LoRA weight inputs, "
                             f"its LoraSpec {expected}: rebuild it")
        self._scales = np.zeros((spec.max_loras + 1, self.width), self.dtype)
        self.names: list[str | None] = [None] * spec.max_loras  # the adapter in each slot

    def bind(self, binding: ort.IOBinding) -> None:
        """Bind every A and B buffer to ``binding`` by pointer (once per binding)."""
        for name, buf in self.buffers.items():
            binding.bind_input(name, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)

    def set(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write ``adapter`` into ``slot`` in place (zero-padded to rank R) and remember its
        scaling; None clears the slot. The adapter is checked before anything is written."""
        spec = self.spec
        if not 0 <= slot < spec.max_loras:
            raise ValueError(f"LoRA slot {slot} outside [0, {spec.max_loras})")
        writes: list[tuple[str, np.ndarray, np.ndarray]] = []  # ("{target}_{layer}", A, B)
        if adapter is not None:
            if adapter.rank > self.rank:
                raise ValueError(f"adapter {adapter.name}: rank {adapter.rank} > max_lora_rank {self.rank}")
            for (layer, target), (a, b) in adapter.weights.items():
                key = f"{target}_{layer}"
                if "lora_a_" + key not in self.buffers:
                    raise ValueError(f"adapter {adapter.name}: layer {layer} {target} is not a "
                                     f"target of this engine ({', '.join(spec.targets)})")
                d_in, d_out = self.dims[target]
                r = a.shape[1] if a.ndim == 2 else -1
                if a.shape != (d_in, r) or b.shape != (r, d_out) or r > self.rank:
                    raise ValueError(f"adapter {adapter.name}: layer {layer} {target} A {a.shape}, "
                                     f"B {b.shape}; the engine wants ({d_in}, r), (r, {d_out}), "
                                     f"r <= {self.rank}")
                writes.append((key, a, b))
        cols = slice(slot * self.rank, (slot + 1) * self.rank)
        for name, buf in self.buffers.items():  # zero the slot (a smaller rank, absent targets)
            if name.startswith("lora_a_"):
                buf[:, cols] = 0
            else:
                buf[cols] = 0
        for key, a, b in writes:
            first, r = slot * self.rank, a.shape[1]
            self.buffers["lora_a_" + key][:a.shape[0], first:first + r] = a
            self.buffers["lora_b_" + key][first:first + r, :b.shape[1]] = b
        self._scales[slot] = 0
        if adapter is not None:
            self._scales[slot, cols] = adapter.scaling
        self.names[slot] = adapter.name if adapter is not None else None

    def mask(self, rows: Sequence[EngineRow], num_tokens: int) -> np.ndarray:
        """``lora_mask`` (num_tokens, S*R) of a call packing ``rows`` (their tokens first, in
        row order; any further tokens, padding, get zeros)."""
        count = len(rows)
        slots = np.fromiter((r.lora_slot for r in rows), np.int64, count)
        bad = np.flatnonzero((slots < -1) | (slots >= self.spec.max_loras))
        if len(bad):
            raise ValueError(f"row lora_slot {int(slots[bad[0]])} outside [-1, {self.spec.max_loras})")
        for s in set(slots[slots >= 0].tolist()):
            if self.names[s] is None:
                raise ValueError(f"row lora_slot {s}: the slot holds no adapter")
        lengths = np.fromiter((len(r.token_ids) for r in rows), np.int64, count)
        n = int(lengths.sum())
        token_slots = np.full(num_tokens, -1, np.int64)
        token_slots[:n] = np.repeat(slots, lengths)
        return self._scales[token_slots]  # -1: the last (zero) row
