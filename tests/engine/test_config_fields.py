"""No config.json field goes unread: every field transformers' config classes define for the
served architectures is either served or listed as having no effect (``config_fields.py``),
the defaults inferflow assumes for a field left out are transformers' own, and the rotary
frequencies and activations are transformers' (the oracle tests then check whole models)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferflow.models.config_fields import (
    ACTIVATIONS,
    ARCHITECTURES,
    no_effect_fields,
    read_fields,
)
from inferflow.models.rope import cos_sin_cache, inv_freq, read_rotary

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _config_class(architecture: str) -> Any:
    text = "Text" if architecture == "Gemma3ForCausalLM" else ""  # Gemma 3's text-only config
    return getattr(transformers, architecture.replace("ForCausalLM", f"{text}Config"))


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_every_field_transformers_defines_is_read_or_has_no_effect(architecture: str) -> None:
    written = set(_config_class(architecture)().to_dict())  # what save_pretrained can write
    family = ARCHITECTURES[architecture]
    read, no_effect = read_fields(family), no_effect_fields(family)
    unclassified = written - read - no_effect
    assert not unclassified, f"{architecture}: classify {sorted(unclassified)} in its family module"
    assert not read & no_effect


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_defaults_for_fields_left_out_are_transformers_defaults(architecture: str) -> None:
    cls = _config_class(architecture)
    class_defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, ours in ARCHITECTURES[architecture].defaults.items():
        if ours is None and key in ("head_dim", "num_key_value_heads"):
            continue  # derived from hidden_size / num_attention_heads when absent or null
        assert class_defaults[key] == ours, f"{architecture}.{key}"
    assert cls.model_type == ARCHITECTURES[architecture].model_type


def test_activations_are_transformers_act2fn() -> None:
    from transformers.activations import ACT2FN

    from inferflow.runtimes.torch_engine.model import ACTIVATIONS as TORCH_FORMS

    x = torch.linspace(-6, 6, 2001)
    for name, form in ACTIVATIONS.items():
        np.testing.assert_allclose(TORCH_FORMS[form](x).numpy(), ACT2FN[name](x).numpy(),
                                   atol=2e-6, err_msg=name)


ROPES: list[dict[str, Any]] = [
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "linear", "factor": 3.0, "rope_theta": 5e5},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256, "rope_theta": 5e5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 1e5},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128, "rope_theta": 1e4,
     "beta_fast": 8.0, "beta_slow": 0.5, "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "rope_theta": 1e4,
     "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "original_max_position_embeddings": 256, "rope_theta": 1e4,
     "attention_factor": 1.3, "factor": None},
]


@pytest.mark.parametrize("params", ROPES, ids=lambda p: f"{p['rope_type']}-{p.get('factor')}")
def test_rotary_frequencies_are_transformers(params: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, max_position_embeddings=1024,
                                      rope_parameters=dict(params))
    rope = read_rotary(Path("config.json"), config.to_dict(), 1024)
    if params["rope_type"] == "default":
        ref, attention = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        ref, attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    np.testing.assert_allclose(inv_freq(rope, 64), ref.numpy(), rtol=1e-6)
    assert rope.attention_factor == pytest.approx(attention, rel=1e-7)
    cos, _ = cos_sin_cache(rope, 64, 4)
    assert cos[0, 0] == pytest.approx(attention, rel=1e-6)  # cos(0) scaled, as transformers
