"""What inferflow does with each ``config.json`` field of the architectures it serves.

Every field transformers' config classes define for these architectures (``LlamaConfig``,
``MistralConfig``, ``Qwen2Config`` and their ``PreTrainedConfig`` base) is in exactly one of:

- ``READ``: parsed by ``parse_model_config`` and served as transformers computes it, or the
  checkpoint refused in one line naming the field and value when a value is not supported;
- ``NO_EFFECT``: bookkeeping or training-only; nothing at inference depends on it.

``tests/engine/test_config_fields.py`` holds this list against transformers' classes, so a
field a new transformers release adds fails a test instead of being ignored unread. Keys that
no config class of the architecture defines are ignored by transformers' modeling code too,
and so here, except ``quantization_config`` (transformers would dequantize or run the
checkpoint's quantized kernels): that one is refused.

``ARCHITECTURES`` holds, per architecture, transformers' class defaults for the fields a
config.json may leave out (a Mistral file without ``sliding_window`` has a 4,096-token window,
a Qwen2 file without ``max_position_embeddings`` a 32,768-token context) and which projections
carry biases (``attention_bias`` is a Llama field; Qwen2 always biases q/k/v, never o).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

READ = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
    "attention_bias", "mlp_bias", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "dtype", "torch_dtype", "quantization_config",
})

NO_EFFECT = frozenset({
    "transformers_version", "_name_or_path", "output_hidden_states", "output_attentions",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "initializer_range", "use_cache", "pad_token_id",
    "attention_dropout",  # dropout is off at inference
    "pretraining_tp",  # transformers 4 split the matmuls into this many slices: the same product
})

# hidden_act -> the activation the executors implement (transformers' ACT2FN names)
ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu",  # erf form
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "relu": "relu",
}


@dataclass(frozen=True)
class Architecture:
    """One served architecture: its class defaults and where its projections carry biases."""

    model_type: str
    defaults: dict[str, Any] = field(default_factory=dict)
    qkv_bias: str | bool = False  # a config key naming the switch, or fixed
    o_bias: str | bool = False
    mlp_bias: str | bool = False
    sliding: str = "none"  # none | all (Mistral: every layer) | layer_types (Qwen2)


_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "head_dim": None, "num_key_value_heads": None}

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        "llama", {**_COMMON, "max_position_embeddings": 2048, "bos_token_id": 1,
                  "eos_token_id": 2, "attention_bias": False, "mlp_bias": False},
        qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "MistralForCausalLM": Architecture(
        "mistral", {**_COMMON, "max_position_embeddings": 131072, "bos_token_id": 1,
                    "eos_token_id": 2, "num_key_value_heads": 8, "sliding_window": 4096},
        sliding="all"),
    "Qwen2ForCausalLM": Architecture(
        "qwen2", {**_COMMON, "max_position_embeddings": 32768, "bos_token_id": None,
                  "eos_token_id": None, "num_key_value_heads": 32, "use_sliding_window": False,
                  "sliding_window": 4096, "max_window_layers": 28},
        qkv_bias=True, sliding="layer_types"),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def switch(raw: dict[str, Any], arch: Architecture, rule: str | bool) -> bool:
    """A bias rule read from config.json: a fixed value, or the key it names (class default)."""
    if isinstance(rule, bool):
        return rule
    return bool(raw.get(rule, arch.defaults.get(rule, False)))


def sliding_window(raw: dict[str, Any], arch: Architecture, num_layers: int) -> int | None:
    """The attention window of the layers that have one (None: every layer sees the whole
    context), as transformers derives it: Mistral's ``sliding_window`` for every layer; Qwen2's
    window only with ``use_sliding_window``, on the layers ``layer_types`` marks (when the file
    has them: they are the truth), else on the layers from ``max_window_layers`` on. A layer
    type other than full or sliding attention is a ``ValueError``."""
    window = raw.get("sliding_window", arch.defaults.get("sliding_window"))
    if arch.sliding == "all":
        return int(window) if window is not None else None
    if arch.sliding != "layer_types":
        return None
    if not raw.get("use_sliding_window", arch.defaults.get("use_sliding_window")) or window is None:
        return None
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", arch.defaults.get("max_window_layers", 0)))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown[0]!r} is not supported (supported: "
                         "full_attention, sliding_attention)")
    return int(window) if "sliding_attention" in types else None
