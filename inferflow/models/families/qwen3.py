"""Qwen3 (dense): the Qwen2 block without q/k/v biases, with an RMSNorm over each head of q
and k before rotary (``self_attn.q_norm`` / ``k_norm``) and an explicit ``head_dim``."""

from __future__ import annotations

from inferflow.models.families.llama import COMMON
from inferflow.models.family import Block, Family, qwen_windows

QWEN3 = Family(
    "Qwen3ForCausalLM", "qwen3",
    {**COMMON, "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
     "num_key_value_heads": 32, "head_dim": 128, "use_sliding_window": False,
     "sliding_window": 4096, "max_window_layers": 28, "attention_bias": False},
    reads=frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types",
                     "attention_bias"}),
    qkv_bias="attention_bias", o_bias="attention_bias", windows=qwen_windows,
    block=lambda raw, defaults: Block(qk_norm=True))

FAMILIES = (QWEN3,)
