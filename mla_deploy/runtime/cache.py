"""Preallocated latent/rope cache buffers, written in place by the graphs through IO binding.

Design (measured in benchmarks/): each layer owns two buffers [batch, capacity, width] that are
bound both as `past_*` input and `present_*` output. The graph's TensorScatter writes the new
entries into them, so a decode step moves only the new token's 576 values per layer, never the
whole cache. Attention reads all `capacity` slots (later ones masked), so capacity grows in
blocks as the sequence grows instead of being fixed at the maximum length: a step costs the
context rounded up to a block, and a grow copies the cache once per block.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from .. import io_spec
from ..config import MLAConfig
from ..errors import InputError

BLOCK = 256  # slots added per growth step


class CacheBuffers:
    """The per-layer caches of one generation (one batch of rows), owned by the caller's thread."""

    def __init__(self, cfg: MLAConfig, batch: int, capacity: int, max_capacity: int, device: str):
        self.cfg, self.batch, self.device, self.max_capacity = cfg, batch, device, max_capacity
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
        cfg = self.cfg
        for name, width in io_spec.cache_widths(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim).items():
            new = np.zeros((self.batch, capacity, width), np.float32)
            old = self.arrays.get(name)
            if old is not None:
                new[:, : self.capacity] = old if self.device == "cpu" else self.values[name].numpy()
            self.arrays[name] = new
            self.values[name] = ort.OrtValue.ortvalue_from_numpy(new, self.device, 0)
        self.capacity = capacity
        return True

    def bind(self, binding: ort.IOBinding) -> None:
        """Bind every cache as both the past input and the present output: in-place update."""
        for past, present in io_spec.cache_pairs(self.cfg.num_hidden_layers):
            binding.bind_ortvalue_input(past, self.values[past])
            binding.bind_ortvalue_output(present, self.values[past])
