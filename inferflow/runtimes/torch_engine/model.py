"""The Llama-family decoder in torch, built from the checkpoint's ``ModelArch`` (config.json) and
weights as the ONNX graph builder reads them (``Checkpoint.open_weights``, tensor by tensor): one forward for
Llama, Mistral and Qwen2 (q/k/v bias), GQA, tied or untied embeddings, every rope type
``models/rope.py`` serves, the MLP activations of ``config_fields.ACTIVATIONS`` and Llama's
attention and MLP biases.

Why a torch forward and not the ONNX graph lowered to torch: the KV layout differs (paged blocks,
not slots), and the attention is the paged custom op; everything else is a dozen lines that
mirror ``transformers``' ``LlamaDecoderLayer`` operation for operation (RMSNorm in float32, then
cast back and scaled; rotate-half rotary with transformers' cos/sin tables), so fp32 output
matches it token for token.

A step is *packed*: N tokens of all rows back to back (shapes as in ``attention.py``); the
forward returns logits only for ``sample_index`` (R,), the last token of each sampled row.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inferflow.models.checkpoint import LayerWeights, ModelWeights
from inferflow.models.config import ModelArch
from inferflow.models.rope import cos_sin_cache
from inferflow.runtimes.torch_engine.attention import KV_CACHES, paged_attention
from inferflow.runtimes.torch_engine.moe import SparseMoE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _param(array: np.ndarray | None, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    assert array is not None
    return nn.Parameter(torch.from_numpy(np.ascontiguousarray(array)).to(device, dtype),
                        requires_grad=False)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed KV blocks. On CPU through numpy's calloc, so pages are committed only when a block
    is first written (``torch.zeros`` writes every page up front): a large pool costs address
    space, and memory only as it fills. Zeros, not garbage: masked positions must stay finite."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={2: np.int16, 4: np.int32}[itemsize])
    return torch.from_numpy(raw).view(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # as transformers' ACT2FN
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary; x (N, heads, D), cos/sin (N, 1, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    """Weights of one layer in (in_features, out_features) layout: q|k|v and gate|up fused."""

    def __init__(self, arch: ModelArch, w: LayerWeights, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.input_norm = _param(w.input_norm, dtype, device)
        self.wqkv = _param(np.concatenate([w.wq, w.wk, w.wv], axis=1), dtype, device)
        self.bqkv = None  # biases: None where config.json says the projection has none
        if arch.attention_bias:
            assert w.bq is not None and w.bk is not None and w.bv is not None
            self.bqkv = _param(np.concatenate([w.bq, w.bk, w.bv]), dtype, device)
        self.wo = _param(w.wo, dtype, device)
        self.bo = _param(w.bo, dtype, device) if arch.o_proj_bias else None
        self.post_norm = _param(w.post_norm, dtype, device)
        # a sparse layer's MLP is the mixture of experts (moe.py); the dense weights stay unset
        self.moe = SparseMoE(arch.moe, w, dtype, device, ACTIVATIONS[arch.hidden_act]) \
            if arch.moe and arch.is_sparse(w.index) else None
        if self.moe is not None:
            return
        self.w_gate_up = _param(np.concatenate([w.w_gate, w.w_up], axis=1), dtype, device)
        self.b_gate_up = None
        if arch.mlp_bias:
            assert w.b_gate is not None and w.b_up is not None
            self.b_gate_up = _param(np.concatenate([w.b_gate, w.b_up]), dtype, device)
        self.w_down = _param(w.w_down, dtype, device)
        self.b_down = _param(w.b_down, dtype, device) if arch.mlp_bias else None


class TorchLlama(nn.Module):
    """The decoder plus its paged KV cache (``kv_caches[i]`` = K, V of layer i, each
    ``(num_blocks + 1, block_size, Hkv, D)``; the last block is scratch for padding tokens)."""

    def __init__(self, arch: ModelArch, weights: ModelWeights, num_blocks: int, block_size: int,
                 max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.arch = arch
        self.eps = arch.rms_norm_eps
        self.scale = arch.head_dim ** -0.5
        self.act = ACTIVATIONS[arch.hidden_act]
        self.embed = _param(weights.embed, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(arch, w, dtype, device) for w in weights.layers)
        self.decoder_layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        self.final_norm = _param(weights.final_norm, dtype, device)
        self.lm_head = _param(weights.lm_head, dtype, device)
        cos, sin = cos_sin_cache(arch.rope, arch.head_dim, max_positions)  # (P, D/2) float32
        self.register_buffer("cos", torch.from_numpy(np.concatenate([cos, cos], -1)).to(device, dtype))
        self.register_buffer("sin", torch.from_numpy(np.concatenate([sin, sin], -1)).to(device, dtype))
        shape = (num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim)
        # not buffers: the attention op finds them by id (see attention.KVCacheRegistry)
        self.kv_caches = [(zeros(shape, dtype, device), zeros(shape, dtype, device))
                          for _ in range(arch.num_layers)]
        self.cache_id = KV_CACHES.register(self.kv_caches)
        weakref.finalize(self, KV_CACHES.release, self.cache_id)  # the blocks go with the model
        self.scratch_block = num_blocks
        self.block_size = block_size

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_caches[layer]

    @property
    def kv_cache_bytes(self) -> int:
        k, _ = self.kv_cache(0)
        return 2 * len(self.layers) * k.numel() * k.element_size()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start: torch.Tensor, sample_index: torch.Tensor,
                decode_only: bool) -> torch.Tensor:
        """Packed step -> float32 logits (R, V) of ``sample_index``'s tokens."""
        arch = self.arch
        hq, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        n = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        cos_table, sin_table = cast(torch.Tensor, self.cos), cast(torch.Tensor, self.sin)
        cos, sin = cos_table[positions][:, None, :], sin_table[positions][:, None, :]
        for i, layer in enumerate(self.decoder_layers):
            h = rms_norm(x, layer.input_norm, self.eps)
            qkv = h @ layer.wqkv
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = rotate(q.reshape(n, hq, d), cos, sin)
            k = rotate(k.reshape(n, hkv, d), cos, sin)
            attn = paged_attention(q, k, v.reshape(n, hkv, d), slot_mapping, block_tables,
                                   seq_lens, query_start, self.cache_id, i, self.scale,
                                   decode_only)
            out = attn.reshape(n, hq * d) @ layer.wo
            x = x + (out if layer.bo is None else out + layer.bo)
            h = rms_norm(x, layer.post_norm, self.eps)
            if layer.moe is not None:
                x = x + layer.moe(h)
                continue
            gate_up = h @ layer.w_gate_up
            if layer.b_gate_up is not None:
                gate_up = gate_up + layer.b_gate_up
            gate, up = gate_up.chunk(2, dim=-1)
            down = (self.act(gate) * up) @ layer.w_down
            x = x + (down if layer.b_down is None else down + layer.b_down)
        x = rms_norm(x[sample_index], self.final_norm, self.eps)
        return (x @ self.lm_head).float()
