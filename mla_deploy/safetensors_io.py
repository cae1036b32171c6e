"""Safetensors read and write with numpy alone: memory-mapped, bfloat16 included, never unpickles.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then raw little-endian data. Reading it ourselves gives lazy loading of
multi-GB shards, bfloat16 without torch, and errors that name the file and the tensor.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .errors import CheckpointError

_NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_ITEMSIZE = {**{k: np.dtype(v).itemsize for k, v in _NUMPY_DTYPES.items()}, "BF16": 2}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One .safetensors file: its header parsed and checked against the file size, tensors mapped on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
                (n,) = struct.unpack("<Q", head)
                if n > min(_MAX_HEADER, size - 8):
                    raise CheckpointError(f"{self.path}: not a safetensors file or truncated (header length {n}, file {size} bytes)")
                header = json.loads(f.read(n))
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not JSON)") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: corrupt header entry for tensor {name!r}") from None
            if dtype not in _ITEMSIZE:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            if end - begin != int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]:
                raise CheckpointError(f"{self.path}: tensor {name!r} byte range does not match its shape {shape}")
            if self._data_start + end > size:
                raise CheckpointError(
                    f"{self.path}: truncated: tensor {name!r} ends at byte {self._data_start + end}, file has {size}"
                )
            self.entries[name] = (dtype, shape, begin, end)
        self._map = None

    def _mapped(self) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._map

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype (bfloat16 as uint16 bits), memory-mapped, read-only."""
        dtype, shape, begin, end = self.entries[name]
        data = self._mapped()[self._data_start + begin : self._data_start + end]
        np_dtype = np.uint16 if dtype == "BF16" else _NUMPY_DTYPES[dtype]
        return data.view(np_dtype).reshape(shape)  # bytes -> [*shape]

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32 (a copy; bfloat16 widened exactly)."""
        dtype = self.entries[name][0]
        raw = self.raw(name)
        return bf16_to_float32(raw) if dtype == "BF16" else np.array(raw, dtype=np.float32)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 bits -> float32, exactly (bfloat16 is float32's upper half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)  # [...] uint16 -> [...] float32


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write float/int numpy arrays as a safetensors file (used for bundled and preset checkpoints)."""
    names = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items()}
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
