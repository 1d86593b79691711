"""The decoder graph's attention (``llama_graph``), in its two forms, for every dense family.

Per layer ``i`` it reads the family's description off :class:`ModelArch`: the window
(``window(i)``), the rotary (``layer_rope(i)``, ``rotary_dim``), the softmax scale and the score
soft-cap (``block.attn_scale``, ``block.attn_softcap``). Shared tables are made once: one cos/sin
pair per distinct rotary, one causal mask per distinct window (canonical form).

- ``gqa``: ``com.microsoft::GroupQueryAttention`` with ``scale``, ``softcap`` and
  ``local_window_size``. ONNX Runtime's CPU kernel hides key j from the query at position p iff
  j <= p - local_window_size, so ``local_window_size = W`` gives transformers' rule p - W < j <= p
  (checked by ``tests/engine/test_graph_attention.py``). Its rotary turns pairs (n, n + w) of a
  head, w the width of the cos table, a multiple of 8 (the kernel refuses others); partial rotary
  over r = ``rotary_dim`` dims pairs (n, n + r/2) instead, so where r/2 is not a multiple of 8 the
  q and k projections' columns are laid out per head (:func:`gqa_head_layout`) so that the
  kernel's pairs are the model's, the padding pairs turning by 0 (cos 1, sin 0). q·k is the same
  under one permutation of both, and v is not permuted: the output does not change; only the
  K cache holds k in that layout.
- ``paged``: ``inferflow::PagedAttention`` (``runtimes/ort_ops/``), one node per layer on the
  packed tokens, no padding: rotary (pairs (n, n + r/2) over the first r dims, so partial rotary
  needs no head layout), the write of each token's K/V into its block (``slot_mapping``) and
  attention over each row's block table; windows, scale and soft-cap are its attributes. The
  caches are the engine's block pool (``KVLayout.paged``): ``key_cache_{i}`` in,
  ``present_key_{i}`` out, bound to the same memory (the op writes in place).
- ``canonical``: RotaryEmbedding (``rotary_embedding_dim`` for partial rotary), TensorScatter,
  Attention (``scale``, ``softcap``) under a bool mask (B, 1, S, C): key j is visible to the query
  at position p iff j <= p, and p - W < j on a layer with window W.

KV layout and windows (``gqa``, ``canonical``): the slot buffers hold the whole context in both forms, windowed layers
included (every position stays where it was written; a window only hides keys from the
softmax), so prefill, chunked prefill and decode need no layout of their own and the prefix cache
copies blocks as for any layer. A window as long as the rotary tables (``max_model_len``) hides
nothing and is left out of the graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import helper

from inferflow.models.config import ModelArch
from inferflow.models.onnx_graph import PAGED_OP_DOMAIN
from inferflow.models.rope import RotarySettings, cos_sin_cache

if TYPE_CHECKING:
    from inferflow.models.onnx_graph import _Graph

# GroupQueryAttention's CPU kernel (ONNX Runtime 1.32) refuses other head sizes and cos tables
GQA_HEAD_MULTIPLE = 16
GQA_ROTARY_MULTIPLE = 8


def gqa_head_layout(head_dim: int, rotary_dim: int) -> tuple[int, np.ndarray | None]:
    """(w, layout): the cos table width GroupQueryAttention rotates with, and the permutation
    of a head's dims (new dim n holds the model's dim ``layout[n]``; None: as they are) that
    puts the model's rotary pairs (n, n + r/2), n < r/2, where the kernel turns its pairs
    (n, n + w). The kernel's pairs n in [r/2, w) then hold dims that do not rotate."""
    half = rotary_dim // 2
    width = -(-half // GQA_ROTARY_MULTIPLE) * GQA_ROTARY_MULTIPLE
    if width == half:
        return width, None
    if 2 * width > head_dim:
        raise ValueError(f"rotary over {rotary_dim} of {head_dim} dims has no GroupQueryAttention layout")
    extra = width - half  # dims that do not rotate, placed in the padding pairs' first halves
    layout = np.concatenate([np.arange(half), rotary_dim + np.arange(extra), half + np.arange(half),
                             np.arange(rotary_dim + extra, head_dim)])
    return width, layout


def _pad(g: _Graph, x: str, width: int, pad_index: str) -> str:
    """Packed (N, W) -> padded (B, S, W): append a zero row and gather it for padding."""
    zero = g.weight("zero_row", np.zeros((1, width)))
    return g.op1("Gather", [g.op1("Concat", [x, zero], axis=0), pad_index], axis=0)


def _unpad(g: _Graph, y: str, width: int, unpad_index: str) -> str:
    """Padded (B, S, W) -> packed (N, W)."""
    flat = g.op1("Reshape", [y, g.const("shape", np.array([-1, width], np.int64))])
    return g.op1("Gather", [flat, unpad_index], axis=0)


class Attention:
    """Emits layer ``i``'s attention on its packed QKV; holds the tables its layers share."""

    def __init__(self, g: _Graph, cfg: ModelArch) -> None:
        self.g, self.cfg = g, cfg
        d, r = cfg.head_dim, cfg.rotary_dim
        self.layout: np.ndarray | None = None
        self._width = r // 2  # of the cos/sin tables
        if g.spec.form == "gqa" and r < d:
            self._width, self.layout = gqa_head_layout(d, r)
        self._tables: dict[RotarySettings, tuple[str, str]] = {}
        for i in range(cfg.num_layers):  # made now, in layer order (their names follow)
            self._rotary(cfg.layer_rope(i))
        self._masks: dict[int | None, str] = {}  # window -> mask (canonical form)
        self._keys = self._queries = ""  # (C,) key positions, (B, 1, S, 1) query positions

    def in_layout(self, w: np.ndarray, heads: int) -> np.ndarray:
        """``w`` (..., heads * D), a q or k projection (its columns), bias or (D,) norm, with
        each head's dims in the rotary layout of this form (``gqa_head_layout``)."""
        if self.layout is None:
            return w
        d = self.cfg.head_dim
        return w.reshape(*w.shape[:-1], heads, d)[..., self.layout].reshape(w.shape)

    def window(self, i: int) -> int | None:
        """Layer ``i``'s window where it hides a key of some position the graph serves."""
        w = self.cfg.window(i)
        return w if w is not None and w < self.g.spec.max_model_len else None

    def _rotary(self, rope: RotarySettings) -> tuple[str, str]:
        """cos and sin (P, width) of ``rope``: the rotary pairs' angles, then (gqa layout)
        pairs that turn by 0."""
        if rope not in self._tables:
            cos, sin = cos_sin_cache(rope, self.cfg.rotary_dim, self.g.spec.max_model_len)
            pad = self._width - cos.shape[1]
            if pad:
                cos = np.concatenate([cos, np.ones((len(cos), pad), cos.dtype)], axis=1)
                sin = np.concatenate([sin, np.zeros((len(sin), pad), sin.dtype)], axis=1)
            g = self.g
            self._tables[rope] = (g.weight("cos_cache", cos), g.weight("sin_cache", sin))
        return self._tables[rope]

    def __call__(self, i: int, qkv: str) -> str:
        """Packed (N, (Hq + 2*Hkv) * D) -> attention output (N, Hq * D)."""
        cfg, g = self.cfg, self.g
        if g.spec.form == "paged":  # packed in, packed out
            return self._paged(i, qkv)
        qw, kw = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        padded = _pad(g, qkv, qw + 2 * kw, "pad_index")  # (B, S, (Hq + 2*Hkv) * D)
        if g.spec.form == "gqa":
            out = self._gqa(i, padded)
        else:
            q, k, v = g.op("Split", [padded, g.const("split", np.array([qw, kw, kw], np.int64))], 3, axis=-1)
            out = self._canonical(i, q, k, v)
        return _unpad(g, out, qw, "unpad_index")

    def _scores(self) -> dict[str, Any]:
        """The softmax scale and score soft-cap attributes where the family sets them."""
        b = self.cfg.block
        attrs = {"scale": b.attn_scale, "softcap": b.attn_softcap}
        return {name: float(value) for name, value in attrs.items() if value is not None}

    def _gqa(self, i: int, qkv: str) -> str:
        """GroupQueryAttention on packed QKV (key/value inputs absent), rotary inside."""
        cfg, g = self.cfg, self.g
        cos, sin = self._rotary(cfg.layer_rope(i))
        inputs = [qkv, "", "", f"past_key_{i}", f"past_value_{i}", "seqlens_k", "total_seq_len",
                  cos, sin, "", "", "", "", "", "", "", "query_seqlens"]
        window = self.window(i)
        extra: dict[str, Any] = {**self._scores(), **({"local_window_size": window} if window is not None else {})}
        g.nodes.append(helper.make_node(
            "GroupQueryAttention", inputs, [f"attn_{i}", f"present_key_{i}", f"present_value_{i}"],
            name=f"GroupQueryAttention_{i}", domain="com.microsoft", num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads, do_rotary=1, rotary_interleaved=0, **extra))
        return f"attn_{i}"

    def _paged(self, i: int, qkv: str) -> str:
        """PagedAttention on packed QKV (N, (Hq + 2*Hkv) * D) -> (N, Hq * D), rotary inside,
        the step's K/V written into the layer's block pool."""
        cfg, g = self.cfg, self.g
        cos, sin = self._rotary(cfg.layer_rope(i))
        b = cfg.block
        inputs = [qkv, f"key_cache_{i}", f"value_cache_{i}", "positions", "slot_mapping",
                  "block_tables", "seq_lens", "query_start", cos, sin]
        g.nodes.append(helper.make_node(
            "PagedAttention", inputs, [f"attn_{i}", f"present_key_{i}", f"present_value_{i}"],
            name=f"PagedAttention_{i}", domain=PAGED_OP_DOMAIN, num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads, scale=float(b.attn_scale or 0.0),
            softcap=float(b.attn_softcap or 0.0), window=self.window(i) or 0,
            rotary_dim=cfg.rotary_dim))
        return f"attn_{i}"

    def _heads(self, x: str, n: int) -> str:
        """(B, S, n*D) -> (B, n, S, D)."""
        shape = self.g.const("shape", np.array([0, 0, n, self.cfg.head_dim], np.int64))
        return self.g.op1("Transpose", [self.g.op1("Reshape", [x, shape])], perm=[0, 2, 1, 3])

    def _canonical(self, i: int, q: str, k: str, v: str) -> str:
        cfg, g = self.cfg, self.g
        cos, sin = self._rotary(cfg.layer_rope(i))
        partial: dict[str, Any] = {"rotary_embedding_dim": cfg.rotary_dim} if cfg.rotary_dim < cfg.head_dim else {}
        qh = g.op1("RotaryEmbedding", [self._heads(q, cfg.num_heads), cos, sin, "position_ids"], **partial)
        kh = g.op1("RotaryEmbedding", [self._heads(k, cfg.num_kv_heads), cos, sin, "position_ids"], **partial)
        vh = self._heads(v, cfg.num_kv_heads)
        # axis -2 (the sequence dim of (B, Hkv, C, D)), as TensorRT's importer requires to lower
        # TensorScatter to its in-place KV-cache update (``runtimes/tensorrt_graph.py``)
        g.nodes.append(helper.make_node("TensorScatter", [f"past_key_{i}", kh, "write_indices"],
                                        [f"present_key_{i}"], name=f"ScatterK_{i}", axis=-2))
        g.nodes.append(helper.make_node("TensorScatter", [f"past_value_{i}", vh, "write_indices"],
                                        [f"present_value_{i}"], name=f"ScatterV_{i}", axis=-2))
        y = g.op1("Attention", [qh, f"present_key_{i}", f"present_value_{i}", self._mask(self.window(i))],
                  **self._scores())
        y = g.op1("Transpose", [y], perm=[0, 2, 1, 3])  # (B, S, Hq, D)
        return g.op1("Reshape", [y, g.const("shape", np.array([0, 0, -1], np.int64))])

    def _mask(self, window: int | None) -> str:
        """bool (B, 1, S, C): key position j is visible to the query at position p iff j <= p
        (and p - window < j), made once per window."""
        g = self.g
        if not self._masks:  # the causal mask, from the key and query positions windows reuse
            cap = g.op1("Gather", [g.op1("Shape", ["past_key_0"]), g.const("i", np.array(2, np.int64))], axis=0)
            self._keys = g.op1("Range", [g.const("z", np.array(0, np.int64)), cap, g.const("o", np.array(1, np.int64))])
            self._queries = g.op1("Unsqueeze", ["position_ids", g.const("axes", np.array([1, 3], np.int64))])
            self._masks[None] = g.op1("LessOrEqual", [self._keys, self._queries])
        if window is not None and window not in self._masks:
            oldest = g.op1("Sub", [self._queries, g.const("window", np.array(window - 1, np.int64))])
            self._masks[window] = g.op1("And", [self._masks[None], g.op1("GreaterOrEqual", [self._keys, oldest])])
        return self._masks[window]
