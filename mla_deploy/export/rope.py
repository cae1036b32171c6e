"""modeling/rope.py as graph code: rotate-half RoPE and the cos/sin lookup (the tables: mla_deploy.rope)."""

from __future__ import annotations

import functools

import onnx_ir as ir

from .. import rope as rope_math
from ..config import MLAConfig
from .builder import Graph


def rope(op, x: ir.Value, cos: ir.Value, sin: ir.Value) -> ir.Value:
    """Rotate halves: x [..., d_r], cos/sin broadcastable to [..., d_r/2]."""
    x1, x2 = op.Split(x, axis=-1, num_outputs=2, _outputs=2)  # [..., d_r/2] each
    return op.Concat(op.Sub(op.Mul(x1, cos), op.Mul(x2, sin)), op.Add(op.Mul(x2, cos), op.Mul(x1, sin)), axis=-1)


def rope_lookup(g: Graph, cfg: MLAConfig, position_ids: ir.Value) -> tuple[ir.Value, ir.Value]:
    """position_ids [b, T] -> cos, sin [b, T, d_r/2] (float32: rope runs in the attention's float32 island) from
    tables of the plan's max_seq_len positions."""
    op = g.op
    tables = functools.cache(lambda: rope_math.rope_tables(cfg, g.plan.max_seq_len))  # computed once for both
    cos = g.weight("rope.cos", lambda: tables()[0], island=True)  # [max_len, d_r/2]
    sin = g.weight("rope.sin", lambda: tables()[1], island=True)
    return op.Gather(cos, position_ids, axis=0), op.Gather(sin, position_ids, axis=0)
