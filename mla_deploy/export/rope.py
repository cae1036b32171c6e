"""modeling/rope.py as graph code: rotate-half RoPE and the cos/sin lookup (the tables: mla_deploy.rope)."""

from __future__ import annotations

import functools

import onnx_ir as ir

from .. import rope as rope_math
from ..config import MLAConfig
from .builder import Graph


def rope(op, x: ir.Value, cos: ir.Value, sin: ir.Value, heads: int | None = None) -> ir.Value:
    """Rotate halves, x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin over the two halves of each head's d_r: ONNX
    RotaryEmbedding (interleaved=0), one node where the formula written out takes eight. x [b, T, heads·d_r] (3D,
    `heads` given) or [b, heads, T, d_r]; cos / sin [b, T, d_r/2], each token's row (rope_lookup)."""
    return op.RotaryEmbedding(x, cos, sin, interleaved=0, **({"num_heads": heads} if heads is not None else {}))


def rope_lookup(g: Graph, cfg: MLAConfig, position_ids: ir.Value) -> tuple[ir.Value, ir.Value]:
    """position_ids [b, T] -> cos, sin [b, T, d_r/2] (float32: rope runs in the attention's float32 island) from
    tables of the plan's max_seq_len positions."""
    op = g.op
    tables = functools.cache(lambda: rope_math.rope_tables(cfg, g.plan.max_seq_len))  # computed once for both
    cos = g.weight("rope.cos", lambda: tables()[0], island=True)  # [max_len, d_r/2]
    sin = g.weight("rope.sin", lambda: tables()[1], island=True)
    return op.Gather(cos, position_ids, axis=0), op.Gather(sin, position_ids, axis=0)
