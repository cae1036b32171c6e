"""modeling/attention.py as graph code: one layer's MLA, naive in the prefill graph and absorbed in the decode graph,
over the latent and rope caches written in place; and the decode attention core, which the graph runs in
onnxruntime's ops or in mla_deploy.LatentAttention, whose ONNX body is the same core (`latent_attention_function`).

Attention is plain MatMul-Softmax-MatMul, faster on CPU than the fused Attention / GroupQueryAttention ops for
576-wide absorbed heads (docs/benchmarks.md). Caches are written with TensorScatter straight into the graph
outputs, so with IO binding the runtime's buffers are updated in place.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_ir as ir

from .. import kernels
from .. import rope as rope_math
from ..config import MLAConfig
from . import absorb
from .absorb import AbsorbMode
from .builder import BOOL, DATA_TYPES, FLOAT, Graph, Tensors, cast, kernel_function
from .linear import linear
from .norm import RMSNorm
from .rope import rope

NEG_INF = float(np.finfo(np.float32).min)


def attention_bias(op, input_ids: ir.Value, attention_mask: ir.Value, write_indices: ir.Value) -> ir.Value:
    """Additive mask [b, 1, T, cap]: 0 where query t (at slot write_indices + t) sees slot j, else float32 min."""
    seq = op.Gather(op.Shape(input_ids), 1, axis=0)  # T
    cap = op.Gather(op.Shape(attention_mask), 1, axis=0)  # capacity
    query_slot = op.Add(op.Unsqueeze(write_indices, [1]), op.Range(0, seq, 1))  # [b, T]
    causal = op.LessOrEqual(op.Range(0, cap, 1), op.Unsqueeze(query_slot, [2]))  # [cap] vs [b, T, 1] -> [b, T, cap]
    valid = op.Cast(op.Unsqueeze(attention_mask, [1]), to=BOOL)  # [b, 1, cap]
    bias = op.Where(op.And(causal, valid), 0.0, NEG_INF)  # [b, T, cap]
    return op.Unsqueeze(bias, [1])  # [b, 1, T, cap]


def latent_attention_core(op, q_latent: ir.Value, q_rope: ir.Value, latent: ir.Value, rope_cache: ir.Value,
                          bias: ir.Value, cache_type: ir.DataType, long_cache: bool, scale: float | None = None,
                          heads: int | None = None, width: int | None = None):
    """softmax(scale · (q_latent · latent + q_rope · rope) + bias) @ latent -> [b, T·h, d_c] float32: the absorbed
    attention's core, over q_latent [b, T·h, d_c], q_rope [b, T·h, d_r] (float32; token-major), the caches
    [b, cap, d_c] and [b, cap, d_r] as stored (`cache_type`) and bias [b, 1, T, cap]. `heads` None: one query token
    per row (the decode graph, and mla_deploy.LatentAttention's body); else T tokens of `heads` heads, token t
    masked by bias[:, 0, t] (the verify and draft graphs), `width` = d_c. `scale` None: the queries come scaled."""
    latent = cast(op, latent, cache_type, FLOAT)
    scores = op.Add(
        op.MatMul(latent, op.Transpose(q_latent, perm=[0, 2, 1])),  # [b, cap, d_c] @ [b, d_c, T·h] -> [b, cap, T·h]
        op.MatMul(cast(op, rope_cache, cache_type, FLOAT), op.Transpose(q_rope, perm=[0, 2, 1])),  # [b, cap, d_r] @ [b, d_r, T·h] -> [b, cap, T·h]
    )
    if scale is not None:
        scores = op.Mul(scores, scale)
    if heads is None:
        return probs_at_latent(op, scores, bias, latent, long_cache)
    return probs_at_latent_tokens(op, scores, bias, latent, long_cache, heads, width)


def probs_at_latent_tokens(op, logits, bias, latent, long_cache: bool, heads: int, width: int) -> ir.Value:
    """probs_at_latent for T query tokens of `heads` heads each: logits [b, cap, T·h], bias [b, 1, T, cap] (token t's
    own causal mask), latent [b, cap, d_c = width] -> [b, T·h, d_c]; the cache as MatMul's A operand where it is
    long, else B, broadcast over the tokens."""
    by_token = op.Reshape(logits, [0, 0, -1, heads])  # [b, cap, T·h] -> [b, cap, T, h]
    if long_cache:
        probs = op.Softmax(op.Add(by_token, op.Transpose(bias, perm=[0, 3, 2, 1])), axis=1)  # + [b, cap, T, 1]
        o = op.FusedMatMul(latent, op.Reshape(probs, [0, 0, -1]), transA=1, _domain="com.microsoft")  # [b, d_c, T·h]
        return op.Transpose(o, perm=[0, 2, 1])  # [b, d_c, T·h] -> [b, T·h, d_c]
    by_token = op.Transpose(by_token, perm=[0, 2, 3, 1])  # [b, T, h, cap]
    probs = op.Softmax(op.Add(by_token, op.Transpose(bias, perm=[0, 2, 1, 3])), axis=-1)  # + [b, T, 1, cap]
    o = op.MatMul(probs, op.Unsqueeze(latent, [1]))  # [b, T, h, cap] @ [b, 1, cap, d_c] -> [b, T, h, d_c]
    return op.Reshape(o, [0, -1, width])  # [b, T, h, d_c] -> [b, T·h, d_c]


def probs_at_latent(op, logits, bias, latent, long_cache: bool) -> ir.Value:
    """softmax(logits [b, cap, h] + bias [b, 1, 1, cap]) over the cache, times latent [b, cap, d_c] -> [b, h, d_c].
    MLAS packs a MatMul's B operand on every call; for a cache that can outgrow the plan's long-cache size per row,
    packing it costs as much as the product, so such a cache is the A operand (FusedMatMul transA); a short one stays
    B, where the plain MatMul is faster (docs/benchmarks.md). Chosen at export from the maximum length: an If on
    the capacity measured no better on the demo, within this machine's noise. The short path adds the bias after the
    transpose: broadcast over heads it is one row of cap floats per head, where in [b, cap, h] it is one float per
    h-wide row, several times cheaper for onnxruntime's Add."""
    if long_cache:
        logits = op.Add(logits, op.Reshape(bias, [0, -1, 1]))  # [b, 1, 1, cap] -> [b, cap, 1]
        probs = op.Softmax(logits, axis=1)  # [b, cap, h]
        o = op.FusedMatMul(latent, probs, transA=1, _domain="com.microsoft")  # [b, cap, d_c]ᵀ @ [b, cap, h] -> [b, d_c, h]
        return op.Transpose(o, perm=[0, 2, 1])  # [b, d_c, h] -> [b, h, d_c]
    logits = op.Add(op.Transpose(logits, perm=[0, 2, 1]), op.Reshape(bias, [0, 1, -1]))  # [b, h, cap] + [b, 1, cap]
    probs = op.Softmax(logits, axis=-1)  # [b, h, cap]
    return op.MatMul(probs, latent)  # [b, h, cap] @ [b, cap, d_c] -> [b, h, d_c]


def latent_attention_function(cache_dtype: str, long_cache: bool) -> ir.Function:
    """The body of mla_deploy.LatentAttention over `cache_dtype` caches (LatentAttentionLong: a cache that can
    outgrow the long-cache size a row, multiplied as MatMul's A operand): what onnxruntime runs where the kernel
    library is not registered."""
    names = kernels.LATENT_ATTENTION_LONG if long_cache else kernels.LATENT_ATTENTION
    cache = DATA_TYPES[cache_dtype]

    def body(op, q_latent, q_rope, latent, rope_cache, bias):
        return latent_attention_core(op, q_latent, q_rope, latent, rope_cache, bias, cache, long_cache)

    inputs = {"q_latent": FLOAT, "q_rope": FLOAT, "latent": cache, "rope": cache, "bias": FLOAT}
    return kernel_function(names[cache_dtype], inputs, "out", body,
                           f"out = softmax(q_latent · latent + q_rope · rope + bias) @ latent over {cache_dtype} caches "
                           "(the queries already scaled). mla-deploy's kernel library reads the caches as stored and "
                           "only the slots each row sees; this body, where that is not registered, reads every slot"
                           + (", the cache as the A operand" if long_cache else ""),
                           opsets={"com.microsoft": 1} if long_cache else None)


class MLAttention:
    """One layer's MLA: shared projections, then the naive (prefill) or absorbed (decode) core."""

    def __init__(self, g: Graph, cfg: MLAConfig, t: Tensors, layer: int):
        self.g, self.cfg, self.t, self.layer = g, cfg, t, layer
        self.hf = f"model.layers.{layer}.self_attn."
        self.name = f"layers.{layer}.attn"
        self.scale = rope_math.softmax_scale(cfg)

    def _hf(self, name: str) -> Callable[[], np.ndarray]:
        return lambda: self.t(self.hf + name)

    def query_input(self, op, x: ir.Value) -> tuple[ir.Value, Callable[[], np.ndarray]]:
        """x, or c_q = q_norm(W^DQ x) with q LoRA; and the HF weight that maps it to per-head queries."""
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            return x, self._hf("q_proj.weight")
        c_q = linear(self.g, op, x, f"{self.name}.q_a", lambda: self.t(self.hf + "q_a_proj.weight").T)
        c_q = RMSNorm(self.g, f"{self.name}.q_a_norm", self.hf + "q_a_layernorm.weight", self.t, cfg.rms_norm_eps)(op, c_q)
        return c_q, self._hf("q_b_proj.weight")

    def latent_and_rope(self, op, x: ir.Value, cos: ir.Value, sin: ir.Value) -> tuple[ir.Value, ir.Value]:
        """x [b, T, d] -> ĉ [b, T, d_c] (normed), k_pe [b, T, d_r] (roped), both in the caches' stored dtype."""
        cfg, g = self.cfg, self.g
        kv = linear(g, op, x, f"{self.name}.kv_a",
                    lambda: absorb.kv_a_weight(cfg, self.t(self.hf + "kv_a_proj_with_mqa.weight")))
        latent, k_pe = op.Split(kv, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], axis=-1, _outputs=2)
        latent = RMSNorm(g, f"{self.name}.kv_norm", self.hf + "kv_a_layernorm.weight", self.t, cfg.rms_norm_eps)(op, latent)
        k_pe = rope(op, g.to_float(op, k_pe), cos, sin)
        return cast(op, latent, g.compute_type, g.cache_type), cast(op, k_pe, FLOAT, g.cache_type)

    def write_cache(self, op, latent, k_pe, past_latent, past_rope, write_indices) -> tuple[ir.Value, ir.Value]:
        """TensorScatter; the graph makes its outputs the present_* outputs themselves: with the output bound to
        the past buffer, onnxruntime updates it in place (an Identity in between would force a copy)."""
        return (op.TensorScatter(past_latent, latent, write_indices, axis=-2),  # [b, cap, d_c]
                op.TensorScatter(past_rope, k_pe, write_indices, axis=-2))  # [b, cap, d_r]

    def naive(self, op, x, cos, sin, bias, past_latent, past_rope, write_indices):
        """Prefill: decompress K/V from the whole latent cache, standard attention per head."""
        cfg, g, t = self.cfg, self.g, self.t
        h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q_in, q_weight = self.query_input(op, x)
        q = linear(g, op, q_in, f"{self.name}.q", lambda: absorb.query_weight(cfg, q_weight()))  # [b, T, h·(d_nope+d_r)]
        q = op.Transpose(op.Reshape(g.to_float(op, q), [0, 0, h, dn + dr]), perm=[0, 2, 1, 3])  # -> [b, T, h, ·] -> [b, h, T, d_nope+d_r]
        q_nope, q_pe = op.Split(q, [dn, dr], axis=-1, _outputs=2)
        q_pe = rope(op, q_pe, op.Unsqueeze(cos, [1]), op.Unsqueeze(sin, [1]))  # cos [b, 1, T, d_r/2]
        latent, k_pe = self.latent_and_rope(op, x, cos, sin)
        cache_latent, cache_rope = self.write_cache(op, latent, k_pe, past_latent, past_rope, write_indices)

        kv = linear(g, op, cast(op, cache_latent, g.cache_type, g.compute_type), f"{self.name}.kv_b",
                    lambda: t(self.hf + "kv_b_proj.weight").T, quantizable=False)  # [b, cap, h·(d_nope+d_v)]
        kv = op.Transpose(op.Reshape(g.to_float(op, kv), [0, 0, h, dn + dv]), perm=[0, 2, 1, 3])  # -> [b, cap, h, ·] -> [b, h, cap, d_nope+d_v]
        k_nope, v = op.Split(kv, [dn, dv], axis=-1, _outputs=2)
        scores = op.Add(
            op.MatMul(q_nope, op.Transpose(k_nope, perm=[0, 1, 3, 2])),  # [b, h, T, cap]
            op.MatMul(q_pe, op.Unsqueeze(op.Transpose(cast(op, cache_rope, g.cache_type, FLOAT), perm=[0, 2, 1]), [1])),  # k_pe [b, 1, d_r, cap]
        )
        probs = op.Softmax(op.Add(op.Mul(scores, self.scale), bias), axis=-1)
        o = op.Transpose(op.MatMul(probs, v), perm=[0, 2, 1, 3])  # [b, T, h, d_v]
        o = op.Reshape(o, [0, 0, h * dv])  # [b, T, h, d_v] -> [b, T, h·d_v]
        out = linear(g, op, g.to_compute(op, o), f"{self.name}.o", lambda: t(self.hf + "o_proj.weight").T)
        return out, cache_latent, cache_rope

    def absorbed(self, op, x, cos, sin, bias, past_latent, past_rope, write_indices, tokens: bool = False):
        """The query moves into latent space; attention reads ĉ directly; W^UV after. The decode graph: one token per
        row (T = 1); `tokens`: any number T per row (the verify and draft graphs), each seeing the cache up to its own
        slot. The plan picks the absorbed form (fused or factored), the core for one token (mla_deploy.LatentAttention
        or onnxruntime's ops; T tokens: the ops) and the long-cache form."""
        cfg, g, plan = self.cfg, self.g, self.g.plan
        h, dn, dr, dc, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                             cfg.kv_lora_rank, cfg.v_head_dim)
        kv_b = self._hf("kv_b_proj.weight")
        q_in, q_weight = self.query_input(op, x)
        if plan.absorb == AbsorbMode.FUSED:  # the product that overflows half precision first: float32
            q_latent = linear(g, op, g.to_float(op, q_in), f"{self.name}.q_uk",
                              lambda: absorb.fused_query_absorb(cfg, q_weight(), kv_b()), island=True)
            q_latent = op.Reshape(q_latent, [0, -1, dc] if tokens else [0, h, dc])  # [b, T, h·d_c] -> [b, T·h, d_c]
        else:
            q_nope = linear(g, op, q_in, f"{self.name}.q_nope", lambda: absorb.query_nope_weight(cfg, q_weight()))
            q_nope = op.Transpose(op.Reshape(g.to_float(op, q_nope), [-1, h, dn] if tokens else [0, h, dn]),
                                  perm=[1, 0, 2])  # [b, T, h·d_nope] -> [b·T, h, d_nope] -> [h, b·T, d_nope]
            uk = g.weight(f"{self.name}.uk", lambda: absorb.factored_uk(cfg, kv_b()), island=True)
            q_latent = op.Transpose(op.MatMul(q_nope, uk), perm=[1, 0, 2])  # [h, b·T, d_c] -> [b·T, h, d_c]
            if tokens:
                q_latent = op.Reshape(q_latent, op.Concat(op.Shape(x, start=0, end=1), [-1, dc], axis=0))  # [b, T·h, d_c]
        q_pe = linear(g, op, q_in, f"{self.name}.q_rope", lambda: absorb.query_rope_weight(cfg, q_weight()))
        if tokens:
            q_pe = op.Reshape(g.to_float(op, q_pe), [0, 0, h, dr])  # [b, T, h·d_r] -> [b, T, h, d_r]
            q_pe = rope(op, q_pe, op.Unsqueeze(cos, [2]), op.Unsqueeze(sin, [2]))  # cos [b, T, 1, d_r/2]
            q_pe = op.Reshape(q_pe, [0, -1, dr])  # [b, T·h, d_r]
        else:
            q_pe = op.Reshape(g.to_float(op, q_pe), [0, h, dr])  # [b, 1, h·d_r] -> [b, h, d_r]
            q_pe = rope(op, q_pe, cos, sin)  # cos [b, 1, d_r/2] broadcasts over heads
        latent, k_pe = self.latent_and_rope(op, x, cos, sin)
        cache_latent, cache_rope = self.write_cache(op, latent, k_pe, past_latent, past_rope, write_indices)
        if plan.decode_attention == "kernel" and not tokens:  # the softmax scale on the queries: h·(d_c + d_r) products
            names = kernels.LATENT_ATTENTION_LONG if plan.long_cache else kernels.LATENT_ATTENTION
            o_latent = g.kernel_op(op, names[plan.cache_dtype],
                                   lambda: latent_attention_function(plan.cache_dtype, plan.long_cache),
                                   op.Mul(q_latent, self.scale), op.Mul(q_pe, self.scale), cache_latent, cache_rope,
                                   bias)  # [b, h, d_c]
        else:
            o_latent = latent_attention_core(op, q_latent, q_pe, cache_latent, cache_rope, bias, g.cache_type,
                                             plan.long_cache, self.scale, h if tokens else None, dc)  # [b, T·h, d_c]
        o_weight = self._hf("o_proj.weight")
        if plan.absorb == AbsorbMode.FUSED:
            o = op.Reshape(o_latent, [0, -1, h * dc] if tokens else [0, 1, h * dc])  # [b, T·h, d_c] -> [b, T, h·d_c]
            out = g.to_compute(op, linear(g, op, o, f"{self.name}.uv_o",
                                          lambda: absorb.fused_output_absorb(cfg, o_weight(), kv_b()), island=True))  # [b, T, d]
        else:
            if tokens:
                o_latent = op.Reshape(o_latent, [-1, h, dc])  # [b, T·h, d_c] -> [b·T, h, d_c]
            o_latent = op.Transpose(o_latent, perm=[1, 0, 2])  # [b·T, h, d_c] -> [h, b·T, d_c]
            uv = g.weight(f"{self.name}.uv", lambda: absorb.factored_uv(cfg, kv_b()), island=True)
            o = op.Transpose(op.MatMul(o_latent, uv), perm=[1, 0, 2])  # [h, b·T, d_v] -> [b·T, h, d_v]
            o = op.Reshape(o, op.Concat(op.Shape(x, start=0, end=2), [h * dv], axis=0) if tokens
                           else [0, 1, h * dv])  # [b·T, h, d_v] -> [b, T, h·d_v]
            out = linear(g, op, g.to_compute(op, o), f"{self.name}.o", lambda: o_weight().T)
        return out, cache_latent, cache_rope
