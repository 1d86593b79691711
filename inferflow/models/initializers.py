"""Where a graph builder puts its weights: kept in the ONNX model, or streamed to a data file.

A builder hands each initializer to an ``InitializerStore`` as soon as it has computed it and
keeps only the returned ``TensorProto``:

- ``InMemoryInitializers``: the data stays inside the proto (a model for tests and small graphs;
  ``onnx.save_model(..., save_as_external_data=True)`` splits it out later).
- ``ExternalDataWriter``: tensors of ``EXTERNAL_THRESHOLD`` bytes or more are appended to
  ``<folder>/model.onnx.data`` now and the proto only points at them (location, offset, length),
  so the model being built is a skeleton and a tensor's memory is free once it is written.

The two give byte-identical files: the writer applies onnx's own rule (a tensor goes out when
``sys.getsizeof`` of its raw bytes reaches the threshold, appended in initializer order, no
padding) and writes the pointer as onnx's ``set_external_data`` does (location, offset, length).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

DATA_FILE = "model.onnx.data"
EXTERNAL_THRESHOLD = 1024  # onnx.save_model's default size_threshold
_BYTES_OVERHEAD = sys.getsizeof(b"")  # onnx compares sys.getsizeof(raw_data), not its length


class InitializerStore(Protocol):
    def add(self, name: str, value: np.ndarray, data_type: int | None = None,
            shape: tuple[int, ...] | None = None) -> TensorProto:
        """The initializer ``name`` holding ``value``. ``data_type`` and ``shape`` override the
        element type and dims for packed types whose bytes ``value`` already holds (INT4: two
        values per uint8, low nibble first)."""
        ...


def _little_endian(value: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(value, value.dtype.newbyteorder("<"))


def _proto(name: str, value: np.ndarray, data_type: int | None, shape: tuple[int, ...] | None) -> TensorProto:
    tensor = TensorProto()
    tensor.name = name
    tensor.data_type = data_type or helper.np_dtype_to_tensor_dtype(value.dtype)
    tensor.dims.extend(value.shape if shape is None else shape)
    return tensor


class InMemoryInitializers:
    """Initializers that keep their data (``numpy_helper.from_array``)."""

    def add(self, name: str, value: np.ndarray, data_type: int | None = None,
            shape: tuple[int, ...] | None = None) -> TensorProto:
        if data_type is None and shape is None:
            return numpy_helper.from_array(value, name)
        tensor = _proto(name, value, data_type, shape)
        tensor.raw_data = _little_endian(value).tobytes()
        return tensor


class ExternalDataWriter:
    """Appends large initializers to ``folder/model.onnx.data`` as they are added."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / DATA_FILE
        self._file: BinaryIO = self.path.open("wb")
        self.bytes_written = 0

    def add(self, name: str, value: np.ndarray, data_type: int | None = None,
            shape: tuple[int, ...] | None = None) -> TensorProto:
        if value.nbytes + _BYTES_OVERHEAD < EXTERNAL_THRESHOLD:
            return InMemoryInitializers().add(name, value, data_type, shape)
        tensor = _proto(name, value, data_type, shape)
        data = _little_endian(value)
        self._file.write(data.data.cast("B"))  # no bytes copy of a large tensor
        tensor.data_location = TensorProto.EXTERNAL
        for key, entry in (("location", DATA_FILE), ("offset", self.bytes_written),
                           ("length", data.nbytes)):
            tensor.external_data.add(key=key, value=str(entry))
        self.bytes_written += data.nbytes
        return tensor

    def close(self) -> None:
        """Flush and close the data file (removed when nothing went out to it)."""
        self._file.close()
        if not self.bytes_written:
            self.path.unlink()


def uses_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)
