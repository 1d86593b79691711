"""Rotary position embeddings: the settings read from ``config.json`` and the cos/sin tables,
computed as transformers computes them (``modeling_rope_utils``, float32).

``config.json`` carries the rotary settings in one of two spellings:

- transformers >= 5 writes ``rope_parameters: {"rope_type": ..., "rope_theta": ..., ...}``;
- older files write ``rope_theta`` at the top level and ``rope_scaling: {"rope_type" (or
  "type"): ..., "factor": ..., ...}`` (``null`` for plain RoPE).

Both are read; θ comes from the rope dict when it has one, else from the top-level key
(transformers' order). A file with both dicts is served when they say the same (θ included)
and refused when they disagree: transformers 5.25 then reads ``rope_scaling`` while the
format it writes today is ``rope_parameters``, so either choice could be the wrong one.

Types served, in both executors (the tables are the only place they differ): ``default``,
``linear``, ``dynamic`` (NTK; equal to ``default`` up to ``max_position_embeddings``, which
is as far as inferflow serves, so the served context never reaches transformers' per-step
recomputation), ``yarn`` (with its attention factor folded into cos/sin) and ``llama3``.
``longrope`` (Phi-3/Phi-4) is served with its ``short_factor`` up to
``original_max_position_embeddings``: past it transformers recomputes every position's rotation
with ``long_factor`` while the cache holds keys rotated with the short one, which inferflow does
not reproduce, so a longer served context is refused in one line (``ModelArch.check_context``).
``partial_rotary_factor`` < 1 rotates the first part of each head (the tables are that wide).
Anything else (``proportional``, ...) is refused in one line.

Gemma 3 rotates its local (sliding-window) layers with their own base: transformers 5 nests
``rope_parameters`` by layer type (``{"full_attention": {...}, "sliding_attention": {...}}``),
older files carry ``rope_local_base_freq`` beside ``rope_theta`` (``read_rotary(...,
layer_type=...)`` reads either).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from inferflow.models.errors import CheckpointError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

# keys each rope type reads (besides rope_type / type / rope_theta); anything else in the dict
# that changes the math is refused by name (see _check_keys)
_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "llama3": frozenset({"factor", "original_max_position_embeddings", "low_freq_factor",
                         "high_freq_factor"}),
    "longrope": frozenset({"factor", "original_max_position_embeddings", "attention_factor",
                           "short_factor", "long_factor"}),
}
# keys that never change the math of these types (partial_rotary_factor is checked on its own)
_INERT_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


@dataclass(frozen=True)
class RotarySettings:
    """What the rotary tables depend on (transformers' ``rope_parameters``, standardized).

    ``factor``: linear/dynamic/yarn/llama3 scaling factor (1 for default);
    ``original_max_position_embeddings``: yarn/llama3 (the pre-training context);
    ``attention_factor``: yarn's cos/sin multiplier, resolved (1.0 for every other type).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: floor/ceil the correction range
    attention_factor: float = 1.0
    # rotary over the first int(head_dim * partial_rotary_factor) dims of a head (Phi-4-mini: 0.75)
    partial_rotary_factor: float = 1.0
    # longrope: the per-frequency divisors of positions up to original_max_position_embeddings
    # (transformers switches the whole sequence to long_factor past it; inferflow serves up to it)
    short_factor: tuple[float, ...] = ()

    @property
    def max_context(self) -> int | None:
        """The longest context these tables are right for (None: any)."""
        return self.original_max_position_embeddings if self.rope_type == "longrope" else None

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    def describe(self) -> str:
        extra = f", factor {self.factor:g}" if self.rope_type != "default" else ""
        return f"{self.rope_type} (theta {self.theta:g}{extra})"


LAYER_TYPE_KEYS = frozenset({"full_attention", "sliding_attention"})


def read_rotary(path: Path, raw: Mapping[str, Any], max_position_embeddings: int,
                layer_type: str = "full_attention") -> RotarySettings:
    """The rotary settings of config.json ``raw`` (at ``path``, for errors) for the layers of
    ``layer_type`` (the same for every layer type unless the file nests them, Gemma 3)."""
    legacy, current = raw.get("rope_scaling"), raw.get("rope_parameters")
    if isinstance(current, dict) and current and set(current) <= LAYER_TYPE_KEYS:
        if layer_type not in current:
            raise CheckpointError(path, f"rope_parameters has no entry for {layer_type!r}")
        current = current[layer_type]
        legacy = None  # nested: transformers 5 wrote it, and only today's spelling
    elif layer_type == "sliding_attention" and raw.get("rope_local_base_freq") is not None:
        current, legacy = {"rope_type": "default", "rope_theta": raw["rope_local_base_freq"]}, None
    for key, value in (("rope_scaling", legacy), ("rope_parameters", current)):
        if value is not None and not isinstance(value, dict):
            raise CheckpointError(path, f"{key} must be an object, got {value!r}")
    top_theta = raw.get("rope_theta")
    if legacy and current and _standard(legacy, top_theta) != _standard(current, top_theta):
        raise CheckpointError(
            path, f"rope_scaling {legacy} and rope_parameters {current} disagree (transformers "
            "reads rope_scaling, today's files carry rope_parameters): keep one of them")
    params: dict[str, Any] = dict(current or legacy or {})
    theta = params.get("rope_theta") or top_theta or 10000.0
    rope_type = str(params.get("rope_type") or params.get("type") or "default")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    partial = 1.0 if partial is None else float(partial)
    if not 0.0 < partial <= 1.0:
        raise CheckpointError(path, f"partial_rotary_factor={partial} must be in (0, 1]")
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(path, f"rope type {rope_type!r} is not supported (supported: "
                              f"{', '.join(ROPE_TYPES)})")
    _check_keys(path, rope_type, params)
    if rope_type == "longrope" and "original_max_position_embeddings" not in params:
        original = raw.get("original_max_position_embeddings")  # Phi-3 keeps it at the top level
        if original is not None:
            params["original_max_position_embeddings"] = original
    try:
        settings = _settings(rope_type, float(theta), params, max_position_embeddings)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(path, f"rope settings {params} of type {rope_type!r} are "
                              f"incomplete or malformed (missing or bad {exc})") from None
    return replace(settings, partial_rotary_factor=partial)


def _standard(params: Mapping[str, Any], top_theta: Any) -> dict[str, Any]:
    """A rope dict in one spelling (``type`` -> ``rope_type``, θ filled in), for comparing."""
    out = {k: v for k, v in params.items() if k != "type"}
    out["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    out["rope_theta"] = float(params.get("rope_theta") or top_theta or 10000.0)
    return out


def _check_keys(path: Path, rope_type: str, params: Mapping[str, object]) -> None:
    unknown = sorted(set(params) - _KEYS[rope_type] - _INERT_KEYS)
    if unknown:
        raise CheckpointError(path, f"rope setting {unknown[0]}={params[unknown[0]]!r} is not "
                              f"supported for rope type {rope_type!r}")


def _settings(rope_type: str, theta: float, p: Mapping[str, Any],
              max_position_embeddings: int) -> RotarySettings:
    if rope_type == "default":
        return RotarySettings("default", theta)
    factor = float(p["factor"]) if p.get("factor") is not None else None
    original = p.get("original_max_position_embeddings")
    original = int(original) if original is not None else max_position_embeddings
    if rope_type in ("linear", "dynamic"):
        return RotarySettings(rope_type, theta, float(p["factor"]))
    if rope_type == "llama3":
        return RotarySettings("llama3", theta, float(p["factor"]), original,
                              float(p["low_freq_factor"]), float(p["high_freq_factor"]))
    if rope_type == "longrope":  # factor: the context ratio unless given (transformers)
        factor = factor if factor is not None else max_position_embeddings / original
        attention = p.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        [float(f) for f in p["long_factor"]]  # checked (a malformed file is refused), not served
        return RotarySettings("longrope", theta, factor, original, attention_factor=float(attention),
                              short_factor=tuple(float(f) for f in p["short_factor"]))
    # yarn: a missing factor is the context ratio (DeepSeek-V3's convention, as transformers)
    factor = factor if factor is not None else max_position_embeddings / original
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    return RotarySettings("yarn", theta, factor, original,
                          beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                          truncate=bool(p.get("truncate", True)), attention_factor=float(attention))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(rope: RotarySettings, head_dim: int) -> np.ndarray:
    """(D/2,) float32 inverse frequencies of ``rope`` (transformers' ``ROPE_INIT_FUNCTIONS``)."""
    d = head_dim
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    base = (np.float32(1.0) / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.rope_type in ("default", "dynamic"):  # dynamic: unscaled up to max_position_embeddings
        return base
    if rope.rope_type == "linear":
        return (base / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3(rope, base)
    if rope.rope_type == "longrope":
        if len(rope.short_factor) != d // 2:
            raise ValueError(f"longrope short_factor has {len(rope.short_factor)} values, the "
                             f"rotary dims need {d // 2}")
        exponent_f = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
        ext = np.asarray(rope.short_factor, np.float32)
        return (np.float32(1.0) / (ext * np.float32(rope.theta) ** exponent_f)).astype(np.float32)
    return _yarn(rope, d)


def _llama3(rope: RotarySettings, base: np.ndarray) -> np.ndarray:
    assert rope.original_max_position_embeddings is not None
    old = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = np.where(wavelen > low_wavelen, base / rope.factor, base)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn(rope: RotarySettings, d: int) -> np.ndarray:
    """YaRN: interpolated frequencies below the correction range, extrapolated above it."""
    assert rope.original_max_position_embeddings is not None
    original = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers: prevents a division by zero
    pos_freqs = np.float32(rope.theta) ** (np.arange(0, d, 2).astype(np.float32) / np.float32(d))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)


def cos_sin_cache(rope: RotarySettings, head_dim: int, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables, each (max_positions, D/2) float32; row p is position p, scaled by
    the rope type's attention factor (yarn) as transformers scales its cos/sin."""
    pos = np.arange(max_positions, dtype=np.float32)
    freqs = np.outer(pos, inv_freq(rope, head_dim)).astype(np.float32)  # (P, D/2)
    scale = np.float32(rope.attention_factor)
    return (np.cos(freqs) * scale).astype(np.float32), (np.sin(freqs) * scale).astype(np.float32)
