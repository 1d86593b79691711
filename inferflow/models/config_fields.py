"""What inferflow does with each ``config.json`` field of the architectures it serves.

Every field transformers' config classes define for these architectures (the ``*Config`` of
each family in ``families/`` and their ``PreTrainedConfig`` base) is in exactly one of:

- ``READ``: parsed by ``parse_model_config`` and served as transformers computes it, or the
  checkpoint refused in one line naming the field and value when a value is not supported;
- ``NO_EFFECT``: bookkeeping or training-only; nothing at inference depends on it.

Both are the fields every family reads (``COMMON_READ``/``COMMON_NO_EFFECT``) plus what each
family module adds (``Family.reads``/``ignores``). ``tests/engine/test_config_fields.py`` holds
this list against transformers' classes, so a field a new transformers release adds fails a
test instead of being ignored unread. Keys that no config class of the architecture defines
are ignored by transformers' modeling code too, and so here, except ``quantization_config``
(transformers would dequantize or run the checkpoint's quantized kernels): that one is refused.
"""

from __future__ import annotations

from inferflow.models.families import FAMILIES, SUPPORTED_ARCHITECTURES, Family

COMMON_READ = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "bos_token_id",
    "eos_token_id", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
    "dtype", "torch_dtype", "quantization_config",
})

COMMON_NO_EFFECT = frozenset({
    "transformers_version", "_name_or_path", "output_hidden_states", "output_attentions",
    "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "initializer_range", "use_cache", "pad_token_id",
    "attention_dropout",  # dropout is off at inference
})



def read_fields(family: Family) -> frozenset[str]:
    """The config keys ``family``'s checkpoints are read by."""
    return COMMON_READ | family.reads | {family.activation_key}


def no_effect_fields(family: Family) -> frozenset[str]:
    return COMMON_NO_EFFECT | family.ignores


READ = COMMON_READ.union(*(f.reads for f in FAMILIES.values()))
NO_EFFECT = COMMON_NO_EFFECT.union(*(f.ignores for f in FAMILIES.values()))
ARCHITECTURES: dict[str, Family] = FAMILIES  # the registry, by its older name

# hidden_act -> the activation the executors implement (transformers' ACT2FN names)
ACTIVATIONS = {
    "silu": "silu", "swish": "silu",
    "gelu": "gelu",  # erf form
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "relu": "relu",
}

__all__ = ["ACTIVATIONS", "ARCHITECTURES", "NO_EFFECT", "READ", "SUPPORTED_ARCHITECTURES",
           "no_effect_fields", "read_fields"]
