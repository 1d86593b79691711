"""The decoder in torch, built from the checkpoint's ``ModelArch`` (config.json) and weights as
the ONNX graph builder reads them (``Checkpoint.open_weights``, tensor by tensor): one forward
for every dense family ``models/families/`` describes. The Llama block, GQA, tied or untied
embeddings, every rope type ``models/rope.py`` serves, the MLP activations of
``config_fields.ACTIVATIONS``, q/k/v, output and MLP biases; and where ``ModelArch.block`` says
so: RMSNorm scaling by ``(norm_offset + w)`` in float32 (Gemma), per-head q/k RMSNorm before the
rotary (Qwen3, Gemma 3), sandwich norms (Gemma), an embedding scale, a softmax scale other than
``head_dim ** -0.5``, attention and final-logit soft-capping (Gemma 2); per layer, its sliding
window (``ModelArch.window``) and its rotary (``ModelArch.layer_rope``: Gemma 3's local layers
rotate with their own base); partial rotary (``ModelArch.rotary_dim`` < ``head_dim``: the first
``rotary_dim`` dims of each head rotate, the rest pass through, Phi-4-mini).

Why a torch forward and not the ONNX graph lowered to torch: the KV layout differs (paged blocks,
not slots), and the attention is the paged custom op; everything else is a few dozen lines that
mirror ``transformers``' decoder layers operation for operation (Llama's RMSNorm in float32,
then cast back and scaled; Gemma's scaled in float32, then cast; rotate-half rotary with
transformers' cos/sin tables), so fp32 output matches it token for token.

KV of windowed layers: every layer writes the same paged blocks (one block table per sequence),
windowed or not, and a windowed layer's blocks are kept for the whole sequence; its attention
reads only the positions inside its window (``attention.py``). Freeing the blocks that lie wholly
outside every layer's window (all layers windowed, as Mistral v0.1) is the KV manager's decision;
this model reads nothing outside a window, so what those table entries point at does not matter.

A step is *packed*: N tokens of all rows back to back (shapes as in ``attention.py``); the
forward returns logits only for ``sample_index`` (R,), the last token of each sampled row.

Multi-LoRA (``inferflow.lora``, built only with a ``LoraSpec``): every target projection of every
layer gains ``((x @ A_all) * mask) @ B_all`` with ``A_all`` (d_in, S*R), ``B_all`` (S*R, d_out)
(S slots of rank R) and the step's ``lora_mask`` (N, S*R) (each token's adapter scaling on its
slot's R columns). The stacks are *inputs* of the forward (``TorchLlama.lora_weights``), not
parameters or buffers: Inductor's freezing (CPU) folds parameters and buffers into the compiled
code as constants, which would hide the in-place writes of ``set_lora``; graph inputs are read
on every call (and a CUDA graph reads them at their fixed addresses). Targets that share an
input share one ``A`` (q|k|v: ``A`` (H, T*S*R) with T of them; gate|up alike), so a layer runs
one ``x @ A`` per input. Without a spec the forward is exactly the plain one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from inferflow.lora.adapter import LoraSpec
from inferflow.models.checkpoint import LayerWeights, ModelWeights
from inferflow.models.config import ModelArch
from inferflow.models.rope import RotarySettings, cos_sin_cache
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm over the last dim, normalised in float32. ``offset`` 0 is transformers'
    LlamaRMSNorm (cast back, then ``w *``); otherwise Gemma's (``* (offset + w)`` in float32,
    then cast: Gemma2RMSNorm / Gemma3RMSNorm)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (offset + weight.float())).to(x.dtype)
    return weight * h.to(x.dtype)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # as transformers' ACT2FN
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary over the first R dims of each head (R = cos.shape[-1]; the other
    D - R dims pass through: partial rotary); x (N, heads, D), cos/sin (N, 1, R)."""
    r = cos.shape[-1]
    part = x[..., :r] if r < x.shape[-1] else x
    half = r // 2
    rotated = part * cos + torch.cat((-part[..., half:], part[..., :half]), dim=-1) * sin
    return torch.cat((rotated, x[..., r:]), dim=-1) if r < x.shape[-1] else rotated


def rotary_tables(rope: RotarySettings, rotary_dim: int, max_positions: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (P, R) in ``dtype``: transformers' tables (float32, then cast), both halves."""
    cos, sin = cos_sin_cache(rope, rotary_dim, max_positions)  # (P, R/2) float32
    return (torch.from_numpy(np.concatenate([cos, cos], -1)).to(device, dtype),
            torch.from_numpy(np.concatenate([sin, sin], -1)).to(device, dtype))


# LoRA targets by the input they read: q|k|v the attention's normed input, o the attention output,
# gate|up the MLP's normed input, down the MLP's intermediate activation
LORA_GROUPS: dict[str, tuple[str, ...]] = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                                           "gate_up": ("gate_proj", "up_proj"),
                                           "down": ("down_proj",)}
MLP_TARGETS = frozenset(("gate_proj", "up_proj", "down_proj"))


@dataclass(frozen=True)
class LoraGroup:
    """The LoRA targets of one layer that read the same input: their shared ``A`` is
    ``TorchLlama.lora_weights[a]`` (d_in, T*S*R), target t's columns ``[t*S*R, (t+1)*S*R)``;
    target t's ``B`` (S*R, d_out_t) is ``lora_weights[b[t]]``."""

    targets: tuple[str, ...]
    a: int
    b: tuple[int, ...]


# one step's LoRA inputs: the mask (N, S*R) and TorchLlama.lora_weights
LoraInputs = tuple[torch.Tensor, list[torch.Tensor]]


def lora_deltas(x: torch.Tensor, group: LoraGroup | None,
                lora: LoraInputs | None) -> dict[str, torch.Tensor]:
    """x (N, d_in) -> {target: ((x @ A_t) * mask) @ B_t (N, d_out_t)} for the group's targets
    (empty without LoRA or without targets here)."""
    if group is None or lora is None:
        return {}
    mask, weights = lora
    z = x @ weights[group.a]  # (N, T*S*R)
    if len(group.targets) == 1:
        return {group.targets[0]: (z * mask) @ weights[group.b[0]]}
    z = z.reshape(x.shape[0], len(group.targets), mask.shape[1]) * mask[:, None, :]
    return {t: z[:, j] @ weights[b] for j, (t, b) in enumerate(zip(group.targets, group.b,
                                                                   strict=True))}


class DenseMLP(nn.Module):
    """``act(h W_gate + b) * (h W_up + b) W_down + b``, gate|up fused (in, out) layout."""

    def __init__(self, arch: ModelArch, w: LayerWeights, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.act = ACTIVATIONS[arch.hidden_act]
        self.w_gate_up = _param(np.concatenate([w.w_gate, w.w_up], axis=1), dtype, device)
        self.b_gate_up = None  # biases: None where config.json says the projection has none
        if arch.mlp_bias:
            assert w.b_gate is not None and w.b_up is not None
            self.b_gate_up = _param(np.concatenate([w.b_gate, w.b_up]), dtype, device)
        self.w_down = _param(w.w_down, dtype, device)
        self.b_down = _param(w.b_down, dtype, device) if arch.mlp_bias else None
        # LoRA (TorchLlama with a LoraSpec): gate|up's and down's targets, None: none
        self.lora_gate_up: LoraGroup | None = None
        self.lora_down: LoraGroup | None = None

    def forward(self, h: torch.Tensor, lora: LoraInputs | None = None) -> torch.Tensor:
        """(N, H) -> (N, H); with ``lora`` the gate/up/down adapters' deltas added."""
        gate_up = h @ self.w_gate_up
        if self.b_gate_up is not None:
            gate_up = gate_up + self.b_gate_up
        gate, up = gate_up.chunk(2, dim=-1)
        if lora is not None:
            delta = lora_deltas(h, self.lora_gate_up, lora)
            gate = gate + delta["gate_proj"] if "gate_proj" in delta else gate
            up = up + delta["up_proj"] if "up_proj" in delta else up
        inner = self.act(gate) * up
        down = inner @ self.w_down
        if lora is not None and (delta := lora_deltas(inner, self.lora_down, lora)):
            down = down + delta["down_proj"]
        return down if self.b_down is None else down + self.b_down


class DecoderLayer(nn.Module):
    """Weights of one layer in (in_features, out_features) layout (q|k|v fused), its norms, its
    attention window (0: none) and which rotary table it reads."""

    def __init__(self, arch: ModelArch, w: LayerWeights, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        block, i = arch.block, w.index
        self.window = arch.window(i) or 0
        self.local_rope = arch.local_rope is not None and arch.layer_rope(i) is arch.local_rope
        self.input_norm = _param(w.input_norm, dtype, device)
        self.wqkv = _param(np.concatenate([w.wq, w.wk, w.wv], axis=1), dtype, device)
        self.bqkv = None  # biases: None where config.json says the projection has none
        if arch.attention_bias:
            assert w.bq is not None and w.bk is not None and w.bv is not None
            self.bqkv = _param(np.concatenate([w.bq, w.bk, w.bv]), dtype, device)
        self.wo = _param(w.wo, dtype, device)
        self.bo = _param(w.bo, dtype, device) if arch.o_proj_bias else None
        # (D,) each: per-head RMSNorm of q and k before the rotary
        self.q_norm = _param(w.q_norm, dtype, device) if block.qk_norm else None
        self.k_norm = _param(w.k_norm, dtype, device) if block.qk_norm else None
        # sandwich (Gemma): post_attention_layernorm norms the attention output, the MLP's
        # input norm is pre_feedforward_layernorm and post_feedforward_layernorm its output's;
        # otherwise post_attention_layernorm is the MLP's input norm
        sandwich = block.sandwich_norms
        self.attn_out_norm = _param(w.post_norm, dtype, device) if sandwich else None
        self.mlp_norm = _param(w.pre_ffn_norm if sandwich else w.post_norm, dtype, device)
        self.mlp_out_norm = _param(w.post_ffn_norm, dtype, device) if sandwich else None
        # (N, H) -> (N, H); a sparse layer's is the mixture of experts (moe.py)
        self.mlp: nn.Module = (
            SparseMoE(arch.moe, w, dtype, device, ACTIVATIONS[arch.hidden_act])
            if arch.moe and arch.is_sparse(i) else DenseMLP(arch, w, dtype, device))
        # LoRA (TorchLlama with a LoraSpec): q|k|v's and o's targets, None: none
        self.lora_qkv: LoraGroup | None = None
        self.lora_o: LoraGroup | None = None


class TorchLlama(nn.Module):
    """The decoder plus its paged KV cache (``kv_caches[i]`` = K, V of layer i, each
    ``(num_blocks + 1, block_size, Hkv, D)``; the last block is scratch for padding tokens)."""

    def __init__(self, arch: ModelArch, weights: ModelWeights, num_blocks: int, block_size: int,
                 max_positions: int, dtype: torch.dtype, device: torch.device,
                 lora: LoraSpec | None = None) -> None:
        super().__init__()
        block = arch.block
        self.arch = arch
        self.eps = arch.rms_norm_eps
        self.norm_offset = block.norm_offset
        self.scale = block.attn_scale if block.attn_scale is not None else arch.head_dim ** -0.5
        self.attn_softcap = block.attn_softcap or 0.0
        self.final_softcap = block.final_softcap or 0.0
        self.embed = _param(weights.embed, dtype, device)
        # transformers multiplies by the scale as a tensor of the activation dtype (rounded)
        self.register_buffer("embed_scale", None if block.embed_scale == 1.0
                             else torch.tensor(block.embed_scale).to(device, dtype))
        self.layers = nn.ModuleList(DecoderLayer(arch, w, dtype, device) for w in weights.layers)
        self.decoder_layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        self.final_norm = _param(weights.final_norm, dtype, device)
        self.lm_head = _param(weights.lm_head, dtype, device)
        # (P, R) each; the local (windowed layers') tables only where their rotary differs
        cos, sin = rotary_tables(arch.rope, arch.rotary_dim, max_positions, dtype, device)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        local = arch.local_rope
        tables = (rotary_tables(local, arch.rotary_dim, max_positions, dtype, device)
                  if local is not None else (None, None))
        self.register_buffer("cos_local", tables[0])
        self.register_buffer("sin_local", tables[1])
        shape = (num_blocks + 1, block_size, arch.num_kv_heads, arch.head_dim)
        # not buffers: the attention op finds them by id (see attention.KVCacheRegistry)
        self.kv_caches = [(zeros(shape, dtype, device), zeros(shape, dtype, device))
                          for _ in range(arch.num_layers)]
        self.cache_id = KV_CACHES.register(self.kv_caches)
        weakref.finalize(self, KV_CACHES.release, self.cache_id)  # the blocks go with the model
        self.scratch_block = num_blocks
        self.block_size = block_size
        self.lora = lora
        # LoRA stacks (the forward's lora_weights) and, per (layer, target), its A (d_in, S*R)
        # (a view into its group's A) and B (S*R, d_out): what set_lora writes in place
        self.lora_weights: list[torch.Tensor] = []
        self.lora_slots: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        if lora is not None:
            self._allocate_lora(lora, dtype, device)

    def _allocate_lora(self, spec: LoraSpec, dtype: torch.dtype, device: torch.device) -> None:
        """Zeroed stacks for every target of every layer (see ``LoraGroup``)."""
        arch = self.arch
        mlp_targets = sorted(MLP_TARGETS.intersection(spec.targets))
        sparse = [i for i in range(arch.num_layers) if arch.is_sparse(i)]
        if mlp_targets and sparse:
            raise ValueError(f"lora.target_modules: {', '.join(mlp_targets)} on the "
                             f"mixture-of-experts layers of {arch.architecture}: not supported "
                             "(attention targets only)")
        width = spec.max_loras * spec.max_lora_rank  # S*R
        hidden, attn = arch.hidden_size, arch.num_heads * arch.head_dim
        kv = arch.num_kv_heads * arch.head_dim
        for i, layer in enumerate(self.decoder_layers):
            inner = (layer.mlp.w_down.shape[0] if isinstance(layer.mlp, DenseMLP)
                     else arch.intermediate_size)
            shapes = {"q_proj": (hidden, attn), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
                      "o_proj": (attn, hidden), "gate_proj": (hidden, inner),
                      "up_proj": (hidden, inner), "down_proj": (inner, hidden)}
            groups: dict[str, LoraGroup] = {}
            for name, members in LORA_GROUPS.items():
                targets = tuple(t for t in members if t in spec.targets)
                if not targets:
                    continue
                d_in = shapes[targets[0]][0]
                a = torch.zeros((d_in, len(targets) * width), dtype=dtype, device=device)
                a_index = len(self.lora_weights)
                self.lora_weights.append(a)
                b_index = []
                for t, target in enumerate(targets):
                    b = torch.zeros((width, shapes[target][1]), dtype=dtype, device=device)
                    b_index.append(len(self.lora_weights))
                    self.lora_weights.append(b)
                    self.lora_slots[(i, target)] = (a[:, t * width:(t + 1) * width], b)
                groups[name] = LoraGroup(targets, a_index, tuple(b_index))
            layer.lora_qkv, layer.lora_o = groups.get("qkv"), groups.get("o")
            if isinstance(layer.mlp, DenseMLP):
                layer.mlp.lora_gate_up, layer.mlp.lora_down = groups.get("gate_up"), groups.get("down")
        for tensor in self.lora_weights:  # fixed sizes: no symbols for them under dynamic=True
            torch._dynamo.mark_static(tensor)

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_caches[layer]

    @property
    def kv_cache_bytes(self) -> int:
        k, _ = self.kv_cache(0)
        return 2 * len(self.layers) * k.numel() * k.element_size()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.norm_offset)

    def _rotary(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """{local: (cos, sin)} of the step's positions, each (N, 1, R)."""
        tables = {False: (cast(torch.Tensor, self.cos), cast(torch.Tensor, self.sin))}
        if self.cos_local is not None:
            tables[True] = (cast(torch.Tensor, self.cos_local), cast(torch.Tensor, self.sin_local))
        return {local: (cos[positions][:, None, :], sin[positions][:, None, :])
                for local, (cos, sin) in tables.items()}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start: torch.Tensor, sample_index: torch.Tensor,
                decode_only: bool, lora_mask: torch.Tensor | None = None,
                lora_weights: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Packed step -> float32 logits (R, V) of ``sample_index``'s tokens. With LoRA (a model
        built with a ``LoraSpec``): ``lora_mask`` (N, S*R) and ``lora_weights`` (this model's
        ``lora_weights``) both given; without, neither."""
        arch = self.arch
        lora: LoraInputs | None = None
        if lora_mask is not None:
            assert lora_weights is not None
            lora = (lora_mask, lora_weights)
        hq, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
        n = input_ids.shape[0]
        x = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            x = x * cast(torch.Tensor, self.embed_scale)
        rotary = self._rotary(positions)
        for i, layer in enumerate(self.decoder_layers):
            h = self._norm(x, layer.input_norm)
            qkv = h @ layer.wqkv
            if layer.bqkv is not None:
                qkv = qkv + layer.bqkv
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            if lora is not None:
                delta = lora_deltas(h, layer.lora_qkv, lora)
                q = q + delta["q_proj"] if "q_proj" in delta else q
                k = k + delta["k_proj"] if "k_proj" in delta else k
                v = v + delta["v_proj"] if "v_proj" in delta else v
            q, k = q.reshape(n, hq, d), k.reshape(n, hkv, d)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = self._norm(q, layer.q_norm), self._norm(k, layer.k_norm)
            cos, sin = rotary[layer.local_rope]
            attn = paged_attention(rotate(q, cos, sin), rotate(k, cos, sin), v.reshape(n, hkv, d),
                                   slot_mapping, block_tables, seq_lens, query_start,
                                   self.cache_id, i, self.scale, decode_only, layer.window,
                                   self.attn_softcap)
            attn = attn.reshape(n, hq * d)
            out = attn @ layer.wo
            if lora is not None and (delta := lora_deltas(attn, layer.lora_o, lora)):
                out = out + delta["o_proj"]
            if layer.bo is not None:
                out = out + layer.bo
            if layer.attn_out_norm is not None:
                out = self._norm(out, layer.attn_out_norm)
            x = x + out
            h = self._norm(x, layer.mlp_norm)
            out = layer.mlp(h) if lora is None else layer.mlp(h, lora)
            if layer.mlp_out_norm is not None:
                out = self._norm(out, layer.mlp_out_norm)
            x = x + out
        x = self._norm(x[sample_index], self.final_norm)
        logits = (x @ self.lm_head).float()
        if self.final_softcap:  # in float32 (transformers: in the activation dtype)
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits
