"""Preallocated latent/rope cache buffers, written in place by the graphs through IO binding.

Design (measured in benchmarks/): each layer owns two buffers [batch, capacity, width] (three for an int8 latent:
its scales too; io_spec.CacheFormat) that are bound both as `past_*` input and `present_*` output. The graph's
TensorScatter writes the new entries into them, so a decode step moves only the new token's 576 values per layer
(and its scale), never the whole cache. Attention reads all `capacity` slots (later ones masked), so capacity grows in
blocks as the sequence grows instead of being fixed at the maximum length: a step costs the
context rounded up to a block, and a grow copies the cache once per block.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from .. import io_spec
from ..config import MLAConfig
from ..errors import InputError
from .dtypes import numpy_dtype, ort_value

BLOCK = 256  # slots added per growth step


class CacheBuffers:
    """The per-layer caches of one generation (one batch of rows), owned by the caller's thread."""

    def __init__(self, cfg: MLAConfig, batch: int, capacity: int, max_capacity: int, device: str,
                 dtype: io_spec.CacheFormat | str = "float32", layers: range | None = None):
        """`dtype`: the export's cache format (or one float dtype for both caches; runtime.dtypes); `layers`: the main
        model's (default), or the MTP draft's (io_spec.draft_layers)."""
        self.cfg, self.batch, self.device, self.max_capacity = cfg, batch, device, max_capacity
        self.format = io_spec.CacheFormat.of(dtype)
        self.layers = range(cfg.num_hidden_layers) if layers is None else layers
        self.tensors = self.format.tensors(self.layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        self.capacity = 0
        self.arrays: dict[str, np.ndarray] = {}
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
            new = np.zeros((self.batch, capacity, t.width), numpy_dtype(t.dtype))
            old = self.arrays.get(t.past)
            if old is not None:
                new[:, : self.capacity] = old if self.device == "cpu" else self.values[t.past].numpy()
            self.arrays[t.past] = new
            self.values[t.past] = ort_value(new, t.dtype, self.device)
        self.capacity = capacity
        return True

    def bind(self, binding: ort.IOBinding, rows: slice | None = None) -> list[ort.OrtValue]:
        """Bind every cache as both the past input and the present output: in-place update. `rows` binds only those
        rows, as numpy views of the buffers (CPU; a scheduler's one row, or its occupied prefix). Returns the bound
        OrtValues: a view must outlive the run."""
        values = []
        for t in self.tensors:
            value = self.values[t.past] if rows is None else ort_value(self.arrays[t.past][rows], t.dtype)
            binding.bind_ortvalue_input(t.past, value)
            binding.bind_ortvalue_output(t.present, value)
            values.append(value)
        return values


class DecodeBinding:
    """The decode graph bound once per cache shape over rows [0, rows): input buffers written in place each step,
    logits read from `logits` [rows, 1, vocab] after the run, and the final hidden state from `hidden` [rows, 1, d]
    (None from an export without that output)."""

    def __init__(self, session: ort.InferenceSession, caches: CacheBuffers, rows: int, vocab: int):
        self.rows = rows
        self.ids, self.pos = np.zeros((rows, 1), np.int64), np.zeros((rows, 1), np.int64)
        self.write, self.mask = np.zeros(rows, np.int64), np.ones((rows, caches.capacity), np.int64)
        self.logits = np.zeros((rows, 1, vocab), np.float32)
        self.binding = session.io_binding()
        self._values = [ort.OrtValue.ortvalue_from_numpy(a) for a in (self.ids, self.pos, self.write, self.mask)]
        for name, value in zip((io_spec.INPUT_IDS, io_spec.POSITION_IDS, io_spec.WRITE_INDICES, io_spec.ATTENTION_MASK),
                               self._values):
            self.binding.bind_ortvalue_input(name, value)
        self._values += caches.bind(self.binding, None if rows == caches.batch else slice(0, rows))
        self._values.append(ort.OrtValue.ortvalue_from_numpy(self.logits))
        self.binding.bind_ortvalue_output(io_spec.LOGITS, self._values[-1])
        self.hidden = None
        if io_spec.HIDDEN in {o.name for o in session.get_outputs()}:
            self.hidden = np.zeros((rows, 1, caches.cfg.hidden_size), np.float32)
            self._values.append(ort.OrtValue.ortvalue_from_numpy(self.hidden))
            self.binding.bind_ortvalue_output(io_spec.HIDDEN, self._values[-1])
