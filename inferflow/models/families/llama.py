"""The Llama block itself, and the families that differ from it only in biases and windows:
Llama (optional attention and MLP biases), Mistral (a window on every layer) and Qwen2 (q/k/v
biases, windows on the layers ``layer_types`` marks)."""

from __future__ import annotations

from inferflow.models.family import Family, every_layer, no_windows, qwen_windows

# class defaults every family of transformers' Llama lineage shares
COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
          "head_dim": None, "num_key_value_heads": None}

LLAMA = Family(
    "LlamaForCausalLM", "llama",
    {**COMMON, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
     "attention_bias": False, "mlp_bias": False},
    reads=frozenset({"attention_bias", "mlp_bias"}),
    ignores=frozenset({"pretraining_tp"}),  # transformers 4 split the matmuls: the same product
    qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", windows=no_windows)

MISTRAL = Family(
    "MistralForCausalLM", "mistral",
    {**COMMON, "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2,
     "num_key_value_heads": 8, "sliding_window": 4096},
    reads=frozenset({"sliding_window"}), windows=every_layer)

QWEN2 = Family(
    "Qwen2ForCausalLM", "qwen2",
    {**COMMON, "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
     "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": 4096,
     "max_window_layers": 28},
    reads=frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"}),
    qkv_bias=True, windows=qwen_windows)

FAMILIES = (LLAMA, MISTRAL, QWEN2)
