"""Read ``*.safetensors`` files into float32 numpy arrays, with clear errors.

Our own small reader (the format is an 8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then raw little-endian data) so that bf16 works without
torch and a truncated or malformed file names the file and the tensor.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inferflow.models.errors import CheckpointError

_NUMPY_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ITEMSIZE = {"BF16": 2, **{k: np.dtype(v).itemsize for k, v in _NUMPY_DTYPES.items()}}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte offset into the data section
    end: int


class SafetensorsFile:
    """One safetensors file, memory-mapped; tensors are decoded to float32 on access."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fh = path.open("rb")
        except FileNotFoundError:
            raise CheckpointError(path, "weights file is missing") from None
        size = path.stat().st_size
        if size < 8:
            raise CheckpointError(path, f"truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", self._fh.read(8))
        if header_len > size - 8:
            raise CheckpointError(path, "truncated safetensors file (header runs past the end)")
        try:
            header = json.loads(self._fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(path, "malformed safetensors header") from None
        self._data_start = 8 + header_len
        self.metadata = header.pop("__metadata__", {}) or {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, spec in header.items():
            info = self._tensor_info(name, spec)
            if self._data_start + info.end > size:
                raise CheckpointError(
                    path, f"truncated safetensors file: tensor {name!r} needs bytes up to "
                    f"{self._data_start + info.end}, file has {size}"
                )
            self.tensors[name] = info
        self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def _tensor_info(self, name: str, spec: dict) -> TensorInfo:
        dtype = spec.get("dtype")
        if dtype not in _ITEMSIZE:
            raise CheckpointError(self.path, f"tensor {name!r} has unsupported dtype {dtype!r}")
        shape = tuple(int(d) for d in spec["shape"])
        begin, end = (int(x) for x in spec["data_offsets"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]:
            raise CheckpointError(self.path, f"tensor {name!r}: data size does not match shape {shape}")
        return TensorInfo(name, dtype, shape, begin, end)

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32 (floating types) or its integer dtype."""
        info = self.tensors[name]
        assert self._mm is not None
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=info.end - info.begin,
                            offset=self._data_start + info.begin)
        if info.dtype == "BF16":
            # bf16 is the top half of an fp32: widen by shifting into the high 16 bits.
            out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            out = raw.view(np.dtype(_NUMPY_DTYPES[info.dtype]).newbyteorder("<"))
            out = out.astype(np.float32) if out.dtype.kind == "f" else out.copy()
        return out.reshape(info.shape)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
        self._fh.close()


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes (used in the compiled-engine cache key)."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def iter_shards(folder: Path) -> Iterator[Path]:
    """The safetensors shards of a checkpoint: via the index when sharded, else model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise CheckpointError(index, "malformed index (expected a 'weight_map')") from None
        yield from (folder / name for name in sorted(set(weight_map.values())))
        return
    single = folder / "model.safetensors"
    if not single.exists():
        raise CheckpointError(single, "weights file is missing (no model.safetensors or model.safetensors.index.json)")
    yield single
