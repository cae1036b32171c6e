"""Safetensors read and write with numpy alone: tensor by tensor, bfloat16 included, never unpickles.

The format is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then raw little-endian data. Reading it ourselves gives lazy loading of
multi-GB shards, bfloat16 without torch, and errors that name the file and the tensor.

Tensors are read with positioned reads into fresh memory, not through a memory map: pages of a
mapping stay resident in the reading process after use, so streaming a 31 GB checkpoint through
one would grow its RSS with the checkpoint. Writing streams too (`SafetensorsWriter`): the header
is planned from names, dtypes and shapes, then each tensor is made, written and dropped.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

from .errors import CheckpointError
from .fp8 import e4m3_to_float32

_NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_ITEMSIZE = {**{k: np.dtype(v).itemsize for k, v in _NUMPY_DTYPES.items()}, "BF16": 2, "F8_E4M3": 1}
_BITS = {"BF16": np.uint16, "F8_E4M3": np.uint8}  # stored as raw bits: decoded by bf16_to_float32 / fp8
_MAX_HEADER = 100 * 1024 * 1024
_BLOCK_ELEMENTS = 1 << 22  # bfloat16 is widened this many elements at a time


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
                    raise CheckpointError(
                        f"{self.path}: not a safetensors file or truncated (header length {n}, file {size} bytes)"
                    )
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

    def raw(self, name: str, index: int | None = None, rows: slice | None = None) -> np.ndarray:
        """The tensor in its stored dtype (bfloat16 as uint16 bits, float8_e4m3fn as uint8 codes), read into memory.

        `index` reads one slice along the first axis (`t[index]`), `rows` a range of rows of what remains
        (`t[index, rows]`, or `t[rows]`): one expert of a packed expert tensor, or a block of a large one,
        without reading the rest.
        """
        dtype, shape, begin, _ = self.entries[name]
        np_dtype = _BITS.get(dtype) or _NUMPY_DTYPES[dtype]
        first = 0
        if index is not None:
            first, shape = index * int(np.prod(shape[1:], dtype=np.int64)), shape[1:]
        if rows is not None:  # rows of the first remaining axis
            first += rows.start * int(np.prod(shape[1:], dtype=np.int64))
            shape = (rows.stop - rows.start, *shape[1:])
        count = int(np.prod(shape, dtype=np.int64))
        with open(self.path, "rb") as f:
            data = np.fromfile(
                f, dtype=np_dtype, count=count, offset=self._data_start + begin + first * _ITEMSIZE[dtype]
            )
        return data.reshape(shape)  # [count] -> [*shape]

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32 (bfloat16 widened exactly, block by block: memory is the result plus one block)."""
        dtype, shape = self.entries[name][:2]
        if dtype == "F8_E4M3":  # the codes' values; block scales are the checkpoint's business (mla_deploy.fp8)
            return e4m3_to_float32(self.raw(name))
        if dtype != "BF16":
            return self.raw(name).astype(np.float32, copy=False)
        if len(shape) < 2:
            return bf16_to_float32(self.raw(name))
        out = np.empty(shape, np.float32)
        step = max(1, _BLOCK_ELEMENTS // int(np.prod(shape[1:], dtype=np.int64)))
        for start in range(0, shape[0], step):
            rows = self.raw(name, rows=slice(start, min(start + step, shape[0])))
            out[start : start + rows.shape[0]] = bf16_to_float32(rows)
        return out


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 stored as uint16 bits -> float32, exactly (bfloat16 is float32's upper half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)  # [...] uint16 -> [...] float32


def float32_to_bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even, as torch rounds."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))  # ties to even
    return (rounded >> 16).astype(np.uint16)


def safetensors_dtype(dtype: np.dtype) -> str:
    """A numpy dtype -> the header's dtype name (F32, I64, ...)."""
    names = {np.dtype(v): k for k, v in _NUMPY_DTYPES.items()}
    return names[np.dtype(dtype)]


class SafetensorsWriter:
    """One safetensors file planned from {name: (dtype, shape)}, then written one tensor at a time, in name order.

    `write(name, array)` takes the arrays in the order of `names` (sorted, like safetensors' own writer);
    bfloat16 tensors are given as uint16 bits. `close()` checks that every planned tensor was written.
    """

    def __init__(
        self, path: str | Path, plan: dict[str, tuple[str, tuple[int, ...]]], metadata: dict[str, str] | None = None
    ):
        self.path = Path(path)
        self.names = sorted(plan)
        header: dict = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for name in self.names:
            dtype, shape = plan[name]
            nbytes = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        self._header = header
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self._file = open(self.path, "wb")
        self._file.write(struct.pack("<Q", len(blob)))
        self._file.write(blob)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        self.write_blocks(name, [array])

    def write_blocks(self, name: str, blocks: Iterable[np.ndarray]) -> None:
        """Tensor `name` as consecutive blocks of rows (one block: the whole tensor), each written and dropped."""
        expected = self.names[self._next] if self._next < len(self.names) else None
        if name != expected:
            raise ValueError(f"{self.path}: wrote {name!r}, expected {expected!r} next")
        entry = self._header[name]
        begin, end = entry["data_offsets"]
        written = 0
        for block in blocks:
            if list(block.shape[1:]) != entry["shape"][1:] or block.dtype.itemsize != _ITEMSIZE[entry["dtype"]]:
                raise ValueError(f"{self.path}: {name!r} block {block.dtype}{list(block.shape)} does not fit "
                                 f"{entry['dtype']}{entry['shape']}")
            self._file.write(np.ascontiguousarray(block).data)  # the block's own bytes, no copy
            written += block.nbytes
        if written != end - begin:
            raise ValueError(f"{self.path}: {name!r} got {written} bytes, planned {entry['dtype']}{entry['shape']}")
        self._next += 1

    def close(self) -> None:
        self._file.close()
        if self._next != len(self.names):
            raise ValueError(f"{self.path}: {len(self.names) - self._next} planned tensor(s) never written")

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write float/int numpy arrays as a safetensors file (used for bundled and test checkpoints)."""
    plan = {name: (safetensors_dtype(a.dtype), a.shape) for name, a in tensors.items()}
    with SafetensorsWriter(path, plan, metadata) as writer:
        for name in writer.names:
            writer.write(name, tensors[name])
