"""The export's one weights file, written while the graphs are built: each tensor once, then dropped.

A graph asks for a weight by name with a function that makes it (read from the checkpoint, transposed,
absorbed); the first ask computes it, appends it to `weights.bin` (64-byte aligned) and keeps only its
offset. Both graphs refer to the same bytes as ONNX external data, so at no point does the exporter hold
more than the tensor being written: peak memory follows the largest tensor, not the model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import numpy as np
import onnx_ir as ir

ALIGN = 64


class WeightsFile:
    """weights.bin, appended to tensor by tensor; `tensor(name, make)` returns its external reference."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._tensors: dict[str, ir.ExternalTensor] = {}
        self.shapes: dict[str, tuple[int, int]] = {}  # float [K, N] of each quantized weight, for MatMulNBits' K and N
        self.nbytes = 0

    def tensor(self, name: str, make: Callable[[], np.ndarray]) -> ir.ExternalTensor:
        """The tensor called `name`, written on first use; `make` is not called again for a known name."""
        if name in self._tensors:
            return self._tensors[name]
        array = np.asarray(make())
        if array.dtype != np.uint8:  # quantized codes stay bytes; every float weight is stored float32
            array = array.astype(np.float32, copy=False)
        f = self._file
        f.write(b"\0" * (-f.tell() % ALIGN))
        offset = f.tell()
        _write_rows(f, array)
        self.nbytes = f.tell()
        external = ir.ExternalTensor(self.path.name, offset, array.nbytes, ir.DataType.from_numpy(array.dtype),
                                     shape=ir.Shape(array.shape), name=name, base_dir=self.path.parent)
        self._tensors[name] = external
        return external

    def view(self, name: str, of: str, shape: tuple[int, ...]) -> ir.ExternalTensor:
        """The bytes of the written tensor `of` under another name and shape (no copy in the file)."""
        if name not in self._tensors:
            base = self._tensors[of]
            self._tensors[name] = ir.ExternalTensor(base.location, base.offset, base.length, base.dtype,
                                                    shape=ir.Shape(shape), name=name, base_dir=self.path.parent)
        return self._tensors[name]

    def __enter__(self) -> "WeightsFile":
        return self

    def __exit__(self, exc_type, *_) -> None:
        """Flush and fsync when the graphs were built (their external data must be on disk); just close on error."""
        if exc_type is None:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()


def _write_rows(f, array: np.ndarray, block_bytes: int = 1 << 24) -> None:
    """Little-endian, ONNX's external layout. A transposed view is laid out block by block of rows, so
    writing W^T costs one block of memory beyond W, not a second copy of W."""
    if array.flags.c_contiguous or array.ndim < 2:
        f.write(np.ascontiguousarray(array).data)
        return
    step = max(1, block_bytes // (array[0].nbytes or 1))
    for start in range(0, array.shape[0], step):
        f.write(np.ascontiguousarray(array[start : start + step]).data)  # [step, ...] rows in C order
