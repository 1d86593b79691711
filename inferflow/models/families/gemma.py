"""Gemma 2 and Gemma 3 (text): RMSNorm scaling by ``(1 + w)``, the embedding times
sqrt(hidden_size), GeGLU (``hidden_activation``), four norms per layer (``sandwich_norms``),
softmax scale ``query_pre_attn_scalar ** -0.5``, tanh soft-capping of attention scores (Gemma 2;
transformers' Gemma 3 never applies ``attn_logit_softcapping``) and of final logits where the
config sets it, local (sliding-window) and global layers as
``layer_types`` says (Gemma 2 alternates; Gemma 3 has five local per global, with their own rotary
base: ``rope_parameters`` nested by layer type, or the legacy ``rope_local_base_freq``), and
Gemma 3's q/k norms."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from inferflow.models.family import Block, Family, Raw, windows_from_types


def _block(qk_norm: bool, attn_softcap: bool):  # type: ignore[no-untyped-def]
    def read(raw: Raw, defaults: Mapping[str, Any]) -> Block:
        if raw.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention=true is not supported (a decoder "
                             "attends causally)")

        def get(key: str) -> Any:
            return raw[key] if key in raw else defaults.get(key)

        attn_cap, final_cap = get("attn_logit_softcapping"), get("final_logit_softcapping")
        return Block(norm_offset=1.0, qk_norm=qk_norm, sandwich_norms=True,
                     embed_scale=math.sqrt(int(raw["hidden_size"])),
                     attn_scale=float(get("query_pre_attn_scalar")) ** -0.5,
                     attn_softcap=float(attn_cap) if attn_cap and attn_softcap else None,
                     final_softcap=float(final_cap) if final_cap else None)

    return read


def _windows(pattern: int):  # type: ignore[no-untyped-def]
    """``layer_types`` (the truth when present), else every ``pattern``-th layer global."""

    def read(raw: Raw, defaults: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
        types = raw.get("layer_types")
        if types is None:
            every = int(raw.get("_sliding_window_pattern") or raw.get("sliding_window_pattern")
                        or pattern)
            types = ["sliding_attention" if (i + 1) % every else "full_attention"
                     for i in range(num_layers)]
        window = raw.get("sliding_window", defaults.get("sliding_window"))
        return windows_from_types(list(types), int(window) if window else None)

    return read


_COMMON = {"rms_norm_eps": 1e-6, "num_key_value_heads": 4, "head_dim": 256,
           "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
           "bos_token_id": 2, "eos_token_id": 1, "sliding_window": 4096,
           "query_pre_attn_scalar": 256, "attention_bias": False}
_READS = frozenset({"hidden_activation", "sliding_window", "layer_types", "query_pre_attn_scalar",
                    "attn_logit_softcapping", "final_logit_softcapping", "attention_bias",
                    "use_bidirectional_attention"})

GEMMA2 = Family(
    "Gemma2ForCausalLM", "gemma2",
    {**_COMMON, "max_position_embeddings": 8192, "attn_logit_softcapping": 50.0,
     "final_logit_softcapping": 30.0},
    reads=_READS, qkv_bias="attention_bias", o_bias="attention_bias",
    windows=_windows(2), block=_block(qk_norm=False, attn_softcap=True),
    activation_key="hidden_activation")

GEMMA3 = Family(
    "Gemma3ForCausalLM", "gemma3_text",
    {**_COMMON, "max_position_embeddings": 131072, "attn_logit_softcapping": None,
     "final_logit_softcapping": None},
    reads=(_READS - {"attn_logit_softcapping"})
    | {"_sliding_window_pattern", "sliding_window_pattern", "rope_local_base_freq"},
    # transformers' Gemma 3 attention never applies it (q/k norms replaced soft-capping)
    ignores=frozenset({"attn_logit_softcapping"}),
    qkv_bias="attention_bias", o_bias="attention_bias",
    windows=_windows(6), block=_block(qk_norm=True, attn_softcap=False),
    activation_key="hidden_activation",
    per_layer_type_rope=True)

FAMILIES = (GEMMA2, GEMMA3)
