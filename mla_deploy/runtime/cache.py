"""Preallocated latent/rope cache buffers, written in place by the graphs through IO binding.

Design (measured in benchmarks/): each layer owns two buffers [batch, capacity, width] (three for an int8 latent:
its scales too; io_spec.CacheFormat) that are bound both as `past_*` input and `present_*` output. The graph's
TensorScatter writes the new entries into them, so a decode step moves only the new token's 576 values per layer
(and its scale), never the whole cache. Decode attention in onnxruntime's ops reads all `capacity` slots (later ones
masked; the kernel op and the prefill graph read only the slots a query sees), so capacity grows in blocks as the
sequence grows instead of being fixed at the maximum length: a step costs the context rounded up to a block, and a
grow copies the cache once per block.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnxruntime as ort

from .. import io_spec
from ..config import MLAConfig
from ..errors import InputError
from ..rope import shifted_keys
from .dtypes import ONNX, as_float32, device_value, from_float32, numpy_dtype, ort_value, to_device, to_host
from .prefix import Moved

BLOCK = 256  # slots added per growth step


class CacheBuffers:
    """The per-layer caches of one generation (one batch of rows), owned by the caller's thread.

    Host caches (the CPU default) are numpy arrays, bound as OrtValues over them. Resident caches (`resident`, the
    default on any other device) are onnxruntime's own allocations in the device's memory, bound by address: a step
    writes them in place on the device and nothing of them crosses to the host; they are copied only when they
    grow (once per BLOCK slots)."""

    def __init__(self, cfg: MLAConfig, batch: int, capacity: int, max_capacity: int, device: str,
                 dtype: io_spec.CacheFormat | str = "float32", layers: range | None = None,
                 resident: bool | None = None):
        """`dtype`: the export's cache format (or one float dtype for both caches; runtime.dtypes); `layers`: the main
        model's (default), the MTP draft's (io_spec.draft_layers), or a stage's of a staged export."""
        self.cfg, self.batch, self.device, self.max_capacity = cfg, batch, device, max_capacity
        self.format = io_spec.CacheFormat.of(dtype)
        self.resident = device != "cpu" if resident is None else resident
        self.layers = range(cfg.num_hidden_layers) if layers is None else layers
        self.tensors = self.format.tensors(self.layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        self.dtypes = {t.past: t.dtype for t in self.tensors}
        self.capacity = 0
        self.arrays: dict[str, np.ndarray] = {}  # host caches only
        self.values: dict[str, ort.OrtValue] = {}
        self.ensure(capacity)

    def ensure(self, needed: int) -> bool:
        """Grow to hold `needed` slots (rounded up to BLOCK, at most max_capacity). True when buffers changed."""
        if needed <= self.capacity:
            return False
        if needed > self.max_capacity:
            raise InputError(f"sequence needs {needed} cache slots, the export's maximum length is {self.max_capacity}")
        capacity = min(self.max_capacity, -(-needed // BLOCK) * BLOCK)
        for t in self.tensors:
            # zeros, never uninitialised memory: attention reads every slot, and a masked NaN still poisons its sum
            new = np.zeros((self.batch, capacity, t.width), numpy_dtype(t.dtype))
            if self.capacity:
                new[:, : self.capacity] = self.host(t.past)
            if self.resident:
                self.values[t.past] = to_device(new, t.dtype, self.device)
            else:
                self.arrays[t.past] = new
                self.values[t.past] = ort_value(new, t.dtype)
        self.capacity = capacity
        return True

    def host(self, name: str) -> np.ndarray:
        """Cache `name` [batch, capacity, width] in host memory: the buffer itself for a host cache, a copy of a
        resident one."""
        return self.arrays[name] if not self.resident else to_host(self.values[name], self.dtypes[name])

    def clear_row(self, row: int) -> bool:
        """Every slot of row `row` zeroed: what a row whose entries may hold NaN leaves for its next request (a masked
        NaN still poisons attention's sums). Resident caches through host memory, as when they grow; True when the
        buffers were replaced (their bindings stale)."""
        for t in self.tensors:
            if self.resident:
                host = self.host(t.past)
                host[row] = 0
                self.values[t.past] = to_device(host, t.dtype, self.device)
            else:
                self.arrays[t.past][row] = 0
        return self.resident

    def copy_slots(self, source: int, row: int, slots: int) -> None:
        """Row `row`'s first `slots` slots of every cache become row `source`'s (prefix caching,
        runtime.prefix): host caches only, in place."""
        if self.resident:
            raise ValueError("copy_slots: resident caches are not copied between rows")
        for array in self.arrays.values():
            array[row, :slots] = array[source, :slots]

    def move_slots(self, source: int, row: int, runs: Sequence[Moved]) -> None:
        """Row `row`'s slots [to, to + length) of every cache become row `source`'s [start, start + length), for
        each run, the roped keys moved by to - start positions (rope.shifted_keys; the latent and its scales carry no
        position): a cache shift for reuse past a common start (runtime.prefix.moved_runs). Every run's slots are
        gathered before any is written, so `source` may be `row`. Host caches only."""
        if self.resident:
            raise ValueError("move_slots: resident caches are not shifted")
        if not runs:
            return
        start = np.concatenate([np.arange(run.start, run.start + run.length) for run in runs])
        to = np.concatenate([np.arange(run.to, run.to + run.length) for run in runs])
        for t in self.tensors:
            array = self.arrays[t.past]
            moved = array[source, start]  # a copy
            if t.role == "rope":
                moved = from_float32(shifted_keys(as_float32(moved, t.dtype), self.cfg, to - start), t.dtype)
            array[row, to] = moved

    def bind(self, binding: ort.IOBinding, rows: slice | None = None) -> list[ort.OrtValue]:
        """Bind every cache as both the past input and the present output: in-place update. `rows` binds only those
        rows (a scheduler's one row, or its occupied prefix): numpy views of host caches, the rows' address range of
        resident ones (rows are the outer axis, so any run of them is contiguous). Returns the bound OrtValues: a
        view must outlive the run."""
        values = []
        for t in self.tensors:
            if self.resident and rows is not None:
                self._bind_rows(binding, t, rows)
                continue
            value = self.values[t.past] if rows is None else ort_value(self.arrays[t.past][rows], t.dtype)
            binding.bind_ortvalue_input(t.past, value)
            binding.bind_ortvalue_output(t.present, value)
            values.append(value)
        return values

    def _bind_rows(self, binding: ort.IOBinding, t: io_spec.CacheTensor, rows: slice) -> None:
        start, stop, step = rows.indices(self.batch)
        if step != 1 or stop <= start:
            raise ValueError(f"rows {rows}: a resident cache binds a non-empty run of consecutive rows")
        value = self.values[t.past]
        _, capacity, width = value.shape()
        shape = [stop - start, capacity, width]
        address = value.data_ptr() + start * capacity * width * numpy_dtype(t.dtype).itemsize
        binding.bind_input(t.past, self.device, 0, ONNX[t.dtype], shape, address)
        binding.bind_output(t.present, self.device, 0, ONNX[t.dtype], shape, address)


class DecodeBinding:
    """The decode graph bound once per cache shape over rows [0, rows): input buffers written in place each step,
    logits read from `logits` [rows, 1, vocab] after the run, and the final hidden state from `hidden` [rows, 1, d]
    (None from an export without that output).

    Over resident caches every input and output lives in onnxruntime's memory on the caches' device, at a fixed
    address (what a CUDA graph replays): `run` copies the token ids, positions and write indices in (3 x rows x 8
    bytes), the logits (and the hidden state) out; the attention mask, constant while the capacity is, goes in once,
    here."""

    def __init__(self, session: ort.InferenceSession, caches: CacheBuffers, rows: int, vocab: int):
        self.rows = rows
        self.ids, self.pos = np.zeros((rows, 1), np.int64), np.zeros((rows, 1), np.int64)
        self.write, self.mask = np.zeros(rows, np.int64), np.ones((rows, caches.capacity), np.int64)
        self.logits = np.zeros((rows, 1, vocab), np.float32)
        self.device = caches.device if caches.resident else None  # None: bound as views of the host arrays
        self.binding = session.io_binding()
        inputs = (self.ids, self.pos, self.write, self.mask)
        self._values = [ort_value(a, "int64") if self.device is None else to_device(a, "int64", self.device)
                        for a in inputs]
        self.uploads = [] if self.device is None else list(zip(self._values[:3], inputs[:3]))
        self.downloads: list[tuple[ort.OrtValue, ort.OrtValue]] = []  # (host, device) pairs copied after a run
        for name, value in zip((io_spec.INPUT_IDS, io_spec.POSITION_IDS, io_spec.WRITE_INDICES, io_spec.ATTENTION_MASK),
                               self._values):
            self.binding.bind_ortvalue_input(name, value)
        self._values += caches.bind(self.binding, None if rows == caches.batch else slice(0, rows))
        self._bind_output(io_spec.LOGITS, self.logits)
        self.hidden = None
        if io_spec.HIDDEN in {o.name for o in session.get_outputs()}:
            self.hidden = np.zeros((rows, 1, caches.cfg.hidden_size), np.float32)
            self._bind_output(io_spec.HIDDEN, self.hidden)

    def _bind_output(self, name: str, array: np.ndarray) -> None:
        value = host = ort_value(array, "float32")
        if self.device is not None:
            value = device_value(array.shape, "float32", self.device)
            self.downloads.append((host, value))
        self._values.append(value)
        self.binding.bind_ortvalue_output(name, value)

    def run(self, session: ort.InferenceSession, run_options: ort.RunOptions | None = None) -> None:
        """One decode step over what the caller wrote into ids, pos and write; `logits` (and `hidden`) hold its
        output after."""
        for value, array in self.uploads:
            value.update_inplace(array)
        session.run_with_iobinding(self.binding, run_options)
        for host, value in self.downloads:
            host.update_inplace(value)

    def transfer_bytes(self) -> dict[str, int]:
        """Bytes each `run` copies between the host arrays and the bound buffers, by construction of the binding:
        host<->device on a device, none over host caches."""
        return {"to_device": sum(a.nbytes for _, a in self.uploads),
                "to_host": sum(h.tensor_size_in_bytes() for h, _ in self.downloads)}
