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

from ..safetensors_io import float32_to_bf16

ALIGN = 64
# --dtype -> how a float weight's values are written (bfloat16 as its uint16 bits: numpy has no bfloat16)
STORED = {
    "float32": (ir.DataType.FLOAT, lambda a: a.astype(np.float32, copy=False)),
    "float16": (ir.DataType.FLOAT16, lambda a: a.astype(np.float16)),
    "bfloat16": (ir.DataType.BFLOAT16, lambda a: float32_to_bf16(a)),
}


class WeightsFile:
    """weights.bin, appended to tensor by tensor; `tensor(name, make)` returns its external reference."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "wb")
        self._tensors: dict[str, ir.ExternalTensor] = {}
        # float [K, N] of each quantized weight (MatMulNBits' K and N) and of each float16 MatMulF16 weight (its strips)
        self.shapes: dict[str, tuple[int, int]] = {}
        self.nbytes = 0

    def tensor(self, name: str, make: Callable[[], np.ndarray], dtype: str = "float32") -> ir.ExternalTensor:
        """The tensor called `name`, written on first use as `dtype` (a float weight: float32, float16 or bfloat16;
        quantized codes stay uint8 bytes); `make` is not called again for a known name."""
        if name in self._tensors:
            return self._tensors[name]
        array = np.asarray(make())
        if array.dtype == np.uint8:
            data_type, convert = ir.DataType.UINT8, lambda a: a
        else:
            data_type, convert = STORED[dtype]
        f = self._file
        f.write(b"\0" * (-f.tell() % ALIGN))
        offset = f.tell()
        _write_rows(f, array, convert)
        self.nbytes = f.tell()
        external = ir.ExternalTensor(self.path.name, offset, self.nbytes - offset, data_type,
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


def _write_rows(f, array: np.ndarray, convert: Callable[[np.ndarray], np.ndarray], block_bytes: int = 1 << 24) -> None:
    """Little-endian, ONNX's external layout, each block of rows converted to the stored dtype as it is written.
    A transposed view or a narrowing conversion is done block by block of rows, so writing W^T or W in float16
    costs one block of memory beyond W, not a second copy of W."""
    if array.ndim < 2:
        f.write(np.ascontiguousarray(convert(array)).data)
        return
    step = max(1, block_bytes // (array[0].nbytes or 1))
    for start in range(0, array.shape[0], step):
        f.write(np.ascontiguousarray(convert(array[start : start + step])).data)  # [step, ...] rows in C order
