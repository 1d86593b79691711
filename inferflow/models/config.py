"""Model architecture read from a checkpoint's ``config.json`` (never duplicated in YAML)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferflow.models.errors import CheckpointError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """``rope_scaling`` of type ``llama3`` (Llama 3.1+); ``None`` on ModelArch means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelArch:
    """The decoder-only architecture parameters inferflow's graph builder needs."""

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
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
        per_layer = qkv + self.num_heads * self.head_dim * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_scaling(path: Path, raw: dict[str, Any]) -> RopeScaling | None:
    rs = raw.get("rope_scaling")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise CheckpointError(path, f"rope_scaling type {kind!r} is not supported (supported: llama3)")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def parse_model_config(path: Path) -> ModelArch:
    """Read ``path`` (a config.json) into a :class:`ModelArch`; unsupported models fail clearly."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(path, "config.json is missing (expected a Hugging Face checkpoint folder)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(path, f"is not valid JSON ({exc})") from None
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else raw.get("model_type", "?")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(
            path, f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    try:
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        cfg = ModelArch(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(path, raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", arch == "MistralForCausalLM") else None,
            raw=raw,
        )
    except KeyError as exc:
        raise CheckpointError(path, f"missing required field {exc.args[0]!r}") from None
    if cfg.num_heads % cfg.num_kv_heads:
        raise CheckpointError(path, "num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.head_dim % 2:
        raise CheckpointError(path, "head_dim must be even for rotary embeddings")
    return cfg
