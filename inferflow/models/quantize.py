"""Weight-only quantization of MatMul weights: symmetric, blocked along the input dimension.

A weight ``W`` of shape (K, N) (MatMul layout, y = x @ W) is split into blocks of ``block_size``
consecutive rows of K per output column; each block has one float scale = max|w| / qmax.
Two encodings of the same numbers:
- ``MatMulNBits`` (ORT contrib, CPU form): B (N, K/bs, bs*bits/8) uint8 holding q + zero_point
  (4-bit: two values per byte, low nibble first), scales (N * K/bs,), default zero point
  2^(bits-1).
- ``DequantizeLinear`` (standard op, canonical form): int4/int8 tensor (K, N), scales (K/bs, N),
  axis=0, block_size=bs; the MatMul follows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class QuantizedWeight:
    q: np.ndarray  # (K, N) int8 values in [-qmax-1, qmax]
    scales: np.ndarray  # (K/bs, N) float32
    bits: int
    block_size: int

    @property
    def k(self) -> int:
        return self.q.shape[0]

    @property
    def n(self) -> int:
        return self.q.shape[1]

    def dequantize(self) -> np.ndarray:
        s = np.repeat(self.scales, self.block_size, axis=0)
        return (self.q.astype(np.float32) * s).astype(np.float32)

    def matmulnbits_b(self) -> np.ndarray:
        """(N, K/bs, bs*bits/8) uint8 blob for MatMulNBits."""
        zp = 1 << (self.bits - 1)
        u = (self.q.T.astype(np.int16) + zp).astype(np.uint8)  # (N, K)
        u = u.reshape(self.n, self.k // self.block_size, self.block_size)
        if self.bits == 8:
            return np.ascontiguousarray(u)
        return np.ascontiguousarray((u[..., 0::2] & 0x0F) | ((u[..., 1::2] & 0x0F) << 4))

    def int4_packed(self) -> np.ndarray:
        """(K*N/2,) uint8: the (K, N) values in row-major order, two per byte, low nibble first
        (ONNX's INT4 raw_data layout; a trailing odd value is paired with 0)."""
        flat = self.q.reshape(-1).view(np.uint8) & 0x0F
        if flat.size % 2:
            flat = np.concatenate([flat, np.zeros(1, np.uint8)])
        return np.ascontiguousarray(flat[0::2] | (flat[1::2] << 4))

    def matmulnbits_scales(self) -> np.ndarray:
        return np.ascontiguousarray(self.scales.T).reshape(-1)  # (N * K/bs,)

    @property
    def nbytes(self) -> int:
        return self.k * self.n * self.bits // 8 + self.scales.nbytes


def quantize_blocked(w: np.ndarray, bits: int, block_size: int = 32) -> QuantizedWeight:
    """Symmetric blocked quantization of a (K, N) float32 weight; K must divide by block_size.

    Memory: one float32 temporary the size of ``w`` besides the int8 result (max|w| is taken as
    max(max w, -min w), and rounding and clipping work in place), so a build that quantizes
    tensor by tensor peaks at about three times its largest weight.
    """
    k, n = w.shape
    if k % block_size:
        raise ValueError(f"input dimension {k} is not a multiple of block_size {block_size}")
    qmax = (1 << (bits - 1)) - 1
    blocks = w.reshape(k // block_size, block_size, n)
    amax = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))  # (K/bs, N) = max |w|
    scales = amax / qmax
    scales = np.where(scales == 0, 1.0, scales).astype(np.float32)
    scaled = blocks / scales[:, None, :]
    np.rint(scaled, out=scaled)
    np.clip(scaled, -qmax - 1, qmax, out=scaled)
    return QuantizedWeight(scaled.astype(np.int8).reshape(k, n), scales, bits, block_size)
