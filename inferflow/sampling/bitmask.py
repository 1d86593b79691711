"""Token bitmasks: int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed
(llguidance's, xgrammar's and vLLM's layout). A row for a vocabulary of V tokens has
``ceil(V / 32)`` words."""

from __future__ import annotations

import numpy as np


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """(W,) int32 -> (vocab_size,) bool."""
    bits = np.unpackbits(
        np.ascontiguousarray(bitmask_row, dtype="<i4").view(np.uint8), bitorder="little"
    )
    allowed = np.zeros(vocab_size, dtype=bool)
    n = min(vocab_size, bits.size)
    allowed[:n] = bits[:n].astype(bool)
    return allowed


def bitmask_of(allowed: np.ndarray) -> np.ndarray:
    """(V,) bool -> (ceil(V/32),) int32 (the inverse of ``allowed_tokens``; tests and plugins)."""
    words = words_for(allowed.size)
    bits = np.zeros(words * 32, dtype=np.uint8)
    bits[: allowed.size] = allowed
    return np.packbits(bits, bitorder="little").view("<i4").copy()
