"""Rotary-embedding tables, computed as transformers computes them (float32)."""

from __future__ import annotations

import math

import numpy as np

from inferflow.models.config import ModelArch


def inv_freq(cfg: ModelArch) -> np.ndarray:
    """(D/2,) float32 inverse frequencies, with ``llama3`` rope scaling when configured."""
    d = cfg.head_dim
    base = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    base = base.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return base
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = np.where(wavelen > low_wavelen, base / rs.factor, base)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def cos_sin_cache(cfg: ModelArch, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin tables, each (max_positions, D/2) float32; row p is position p."""
    pos = np.arange(max_positions, dtype=np.float32)
    freqs = np.outer(pos, inv_freq(cfg)).astype(np.float32)  # (P, D/2)
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
