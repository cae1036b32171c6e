"""modeling/norm.py's RMSNorm as graph code."""

from __future__ import annotations

import onnx_ir as ir

from .builder import Graph, Tensors


class RMSNorm:
    def __init__(self, g: Graph, name: str, hf_weight: str, t: Tensors, eps: float):
        self.g, self.name, self.hf_weight, self.t, self.eps = g, name, hf_weight, t, eps

    def __call__(self, op, x: ir.Value) -> ir.Value:
        """Statistics and scaling in float32 whatever the export's dtype (a half-precision sum of squares overflows)."""
        weight = self.g.weight(self.name, lambda: self.t(self.hf_weight), island=True)
        return self.g.to_compute(op, op.RMSNormalization(self.g.to_float(op, x), weight, axis=-1, epsilon=self.eps))
