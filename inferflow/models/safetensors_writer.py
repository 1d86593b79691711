"""Write float32 arrays as safetensors in F32, F16 or BF16 (used to make test checkpoints)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

DTYPE_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 values a tensor has after a round trip through ``dtype``."""
    if dtype == "bfloat16":
        return from_bf16_bits(to_bf16_bits(x))
    return x.astype(dtype).astype(np.float32)


def save_safetensors(tensors: dict[str, np.ndarray], path: Path, dtype: str = "float32") -> None:
    code = DTYPE_CODES[dtype]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        arr = tensors[name]
        data = to_bf16_bits(arr) if dtype == "bfloat16" else np.ascontiguousarray(arr, dtype=dtype)
        raw = data.astype(data.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # align the data section to 8 bytes
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for raw in blobs:
            fh.write(raw)
