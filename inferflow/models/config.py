"""Model architecture read from a checkpoint's ``config.json`` (never duplicated in YAML).

Both formats transformers writes are read: today's (transformers >= 5: ``rope_parameters``,
``dtype``) and the legacy one (``rope_theta`` + ``rope_scaling``, ``torch_dtype``). Every field
that changes the math is either served as transformers computes it or refused in one line
naming the field and value (``config_fields.py`` lists them all; ``rope.py`` the rotary ones);
a field the file leaves out takes the default of transformers' class for the architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferflow.json_types import JSONObject
from inferflow.models.config_fields import (
    ACTIVATIONS,
    ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    Architecture,
    sliding_window,
    switch,
)
from inferflow.models.errors import CheckpointError
from inferflow.models.rope import RotarySettings, read_rotary

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArch", "parse_model_config"]


@dataclass(frozen=True)
class ModelArch:
    """The decoder-only architecture parameters inferflow's graph builders need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RotarySettings
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    torch_dtype: str  # the checkpoint's storage type (config.json's dtype or torch_dtype)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # the window of the layers that have one; None: every layer attends to the whole context
    sliding_window: int | None = None
    hidden_act: str = "silu"  # what the MLP's gate goes through: silu | gelu | gelu_tanh | relu
    o_proj_bias: bool = False  # the attention's output projection has a bias (Llama)
    mlp_bias: bool = False  # gate, up and down projections have biases (Llama's mlp_bias)
    raw: JSONObject = field(default_factory=dict, compare=False, repr=False)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        biases = (q + 2 * kv) * self.attention_bias + h * self.o_proj_bias + (2 * i + h) * self.mlp_bias
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + biases
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head

    def check_context(self, path: Path, served: int, knob: str) -> None:
        """Refuse a served context this engine would compute wrongly: longer than the
        sliding window (not implemented yet; up to the window full attention is the same)."""
        window = self.sliding_window
        if window is not None and window < served:
            raise CheckpointError(
                path, f"sliding_window={window}: attention over a sliding window is not "
                f"supported yet, and the served context ({served} tokens) is longer than the "
                f"window; serve it with {knob}={window} (or less)")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(path, "config.json is missing (expected a Hugging Face checkpoint folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(path, "must hold a JSON object")
    return raw


def _architecture(path: Path, raw: dict[str, Any]) -> tuple[str, Architecture]:
    archs = raw.get("architectures") or []
    by_type = {a.model_type: name for name, a in ARCHITECTURES.items()}
    name = archs[0] if archs else by_type.get(str(raw.get("model_type")), raw.get("model_type", "?"))
    if name not in ARCHITECTURES:
        raise CheckpointError(
            path, f"architecture {name!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return name, ARCHITECTURES[name]


def _refuse_unsupported(path: Path, raw: dict[str, Any], arch: Architecture) -> str:
    """The executors' activation for ``hidden_act``; refuses what no executor computes."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise CheckpointError(
            path, f"quantization_config (quant_method={method!r}) is not supported: serve the "
            "unquantized checkpoint; inferflow quantizes when it builds the engine "
            "(executor.precision=int8 or int4)")
    act = raw.get("hidden_act", arch.defaults["hidden_act"])
    if act not in ACTIVATIONS:
        raise CheckpointError(path, f"hidden_act={act!r} is not supported (supported: "
                              f"{', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def parse_model_config(path: Path) -> ModelArch:
    """Read ``path`` (a config.json) into a :class:`ModelArch`; unsupported models fail clearly."""
    raw = _read(path)
    name, arch = _architecture(path, raw)
    act = _refuse_unsupported(path, raw, arch)

    def get(key: str) -> Any:  # the file's value (null included), else the class default
        return raw[key] if key in raw else arch.defaults.get(key)

    try:
        num_heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        max_positions = int(get("max_position_embeddings"))
        cfg = ModelArch(
            architecture=name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            max_position_embeddings=max_positions,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope=read_rotary(path, raw, max_positions),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            attention_bias=switch(raw, arch, arch.qkv_bias),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=_eos_ids(get("eos_token_id")),
            sliding_window=sliding_window(raw, arch, num_layers),
            hidden_act=act,
            o_proj_bias=switch(raw, arch, arch.o_bias),
            mlp_bias=switch(raw, arch, arch.mlp_bias),
            raw=raw,
        )
    except CheckpointError:
        raise
    except KeyError as exc:
        raise CheckpointError(path, f"missing required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:  # a value of the wrong type, or layer_types
        raise CheckpointError(path, str(exc)) from None
    if cfg.num_heads % cfg.num_kv_heads:
        raise CheckpointError(path, "num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.head_dim % 2:
        raise CheckpointError(path, "head_dim must be even for rotary embeddings")
    return cfg
