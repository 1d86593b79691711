"""Read ``*.safetensors`` files one tensor at a time, with clear errors.

Our own small reader (the format is an 8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}``, then raw little-endian data) so that bf16 works without
torch and a truncated or malformed file names the file and the tensor.

A tensor is read with ``pread`` into memory of its own, not through a memory map: pages of a
mapped multi-GB checkpoint stay resident (and count in the process's RSS) after the tensor is
gone, while a read buffer is freed with the array. A build that reads tensor by tensor so holds
about one tensor of the checkpoint at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
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
    """One safetensors file; each ``read`` decodes one tensor from the file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fh = path.open("rb")
        except FileNotFoundError:
            raise CheckpointError(path, "weights file is missing") from None
        try:
            self._read_header(path.stat().st_size)
        except BaseException:
            self._fh.close()
            raise

    def _read_header(self, size: int) -> None:
        path = self.path
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

    def _tensor_info(self, name: str, spec: dict) -> TensorInfo:
        dtype = spec.get("dtype")
        if dtype not in _ITEMSIZE:
            raise CheckpointError(self.path, f"tensor {name!r} has unsupported dtype {dtype!r}")
        shape = tuple(int(d) for d in spec["shape"])
        begin, end = (int(x) for x in spec["data_offsets"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]:
            raise CheckpointError(self.path, f"tensor {name!r}: data size does not match shape {shape}")
        return TensorInfo(name, dtype, shape, begin, end)

    def read(self, name: str, dtype: np.dtype | type = np.float32) -> np.ndarray:
        """Tensor ``name``: floating types as ``dtype`` (float32 or float16; an F16 tensor read as
        float16 and an F32 one as float32 are not converted), integer types as stored."""
        info = self.tensors[name]
        code, want = info.dtype, np.dtype(dtype)
        if code == "BF16":
            # bf16 is the top half of an fp32: widen by shifting into the high 16 bits
            wide_bits = self._raw(info, np.dtype("<u2")).astype(np.uint32)
            wide_bits <<= 16  # in place: no second 4-byte temporary
            wide = wide_bits.view(np.float32)
            out = wide if want == np.float32 else wide.astype(want)
        else:
            stored = np.dtype(_NUMPY_DTYPES[code]).newbyteorder("<")
            out = self._raw(info, stored)
            if stored.kind == "f" and out.dtype != want:
                out = out.astype(want)
        return out.reshape(info.shape)

    def _raw(self, info: TensorInfo, dtype: np.dtype) -> np.ndarray:
        """The tensor's bytes, read into a new array of ``dtype`` (flat)."""
        out = np.empty((info.end - info.begin) // dtype.itemsize, dtype)
        view, offset = out.view(np.uint8).data, self._data_start + info.begin
        while view.nbytes:  # pread may return less than asked (large reads, signals)
            n = os.preadv(self._fh.fileno(), [view], offset)
            if n == 0:
                raise CheckpointError(self.path, f"truncated safetensors file while reading {info.name!r}")
            view, offset = view[n:], offset + n
        return out

    def close(self) -> None:
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
