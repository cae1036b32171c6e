"""modeling/attention.py as graph code: one layer's MLA, naive in the prefill graph and absorbed in the decode graph,
over the latent and rope caches written in place; and the decode attention core, which the graph runs in
onnxruntime's ops or in mla_deploy.LatentAttention, whose ONNX body is the same core (`latent_attention_function`).

Attention is plain MatMul-Softmax-MatMul, faster on CPU than the fused Attention / GroupQueryAttention ops for
576-wide absorbed heads (docs/benchmarks.md). Caches are written with TensorScatter straight into the graph
outputs, so with IO binding the runtime's buffers are updated in place. An int8 latent cache (io_spec.CacheFormat) is
written as codes and a scale per entry (`quantize_latent`) and read through DequantizeLinear (`read_latent`), or as
stored by mla_deploy.LatentAttentionQ8 and LatentAttentionChunkQ8.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import onnx_ir as ir

from .. import io_spec, kernels
from .. import rope as rope_math
from ..config import MLAConfig
from . import absorb
from .absorb import AbsorbMode
from .builder import BOOL, DATA_TYPES, FLOAT, INT8, Graph, Tensors, cast, kernel_function
from .linear import head_linear, linear, per_head_quantized
from .norm import RMSNorm
from .rope import rope

NEG_INF = float(np.finfo(np.float32).min)
FLT_MIN = float(np.finfo(np.float32).tiny)  # the smallest scale: an all-zero entry's codes are 0, not 0 / 0


class Caches(NamedTuple):
    """One layer's caches as graph values: the latent, the roped key, and the latent's scales (int8 latents only)."""

    latent: ir.Value
    rope: ir.Value
    scale: ir.Value | None = None


def quantize_latent(op, latent: ir.Value) -> tuple[ir.Value, ir.Value]:
    """ĉ [b, T, d_c] float32 -> int8 codes [b, T, d_c] and scales [b, T, 1], io_spec's rule: scale = max(max |ĉ| /
    127, FLT_MIN) per entry, code = clip(round(ĉ / scale), -127, 127) (Round: half to even, as torch.round)."""
    peak = op.ReduceMax(op.Abs(latent), [-1], keepdims=1)  # [b, T, 1]
    scale = op.Max(op.Div(peak, float(io_spec.INT8_MAX)), FLT_MIN)
    codes = op.Clip(op.Round(op.Div(latent, scale)), float(-io_spec.INT8_MAX), float(io_spec.INT8_MAX))
    return op.Cast(codes, to=INT8), scale


def read_latent(op, latent: ir.Value, scale: ir.Value | None, cache_type: ir.DataType, width: int) -> ir.Value:
    """The latent cache [b, cap, d_c] as float32: int8 codes times their entry's scale [b, cap, 1] (DequantizeLinear,
    one block of `width` = d_c per entry), or a float cache widened."""
    if scale is None:
        return cast(op, latent, cache_type, FLOAT)
    return op.DequantizeLinear(latent, scale, axis=-1, block_size=width)


def attention_bias(op, input_ids: ir.Value, attention_mask: ir.Value, write_indices: ir.Value) -> ir.Value:
    """Additive mask [b, 1, T, cap]: 0 where query t (at slot write_indices + t) sees slot j, else float32 min."""
    seq = op.Gather(op.Shape(input_ids), 1, axis=0)  # T
    cap = op.Gather(op.Shape(attention_mask), 1, axis=0)  # capacity
    query_slot = op.Add(op.Unsqueeze(write_indices, [1]), op.Range(0, seq, 1))  # [b, T]
    causal = op.LessOrEqual(op.Range(0, cap, 1), op.Unsqueeze(query_slot, [2]))  # [cap] vs [b, T, 1] -> [b, T, cap]
    valid = op.Cast(op.Unsqueeze(attention_mask, [1]), to=BOOL)  # [b, 1, cap]
    bias = op.Where(op.And(causal, valid), 0.0, NEG_INF)  # [b, T, cap]
    return op.Unsqueeze(bias, [1])  # [b, 1, T, cap]


def latent_attention_core(op, q_latent: ir.Value, q_rope: ir.Value, caches: Caches, bias: ir.Value,
                          cache: io_spec.CacheFormat, width: int, long_cache: bool, scale: float | None = None,
                          heads: int | None = None):
    """softmax(scale · (q_latent · latent + q_rope · rope) + bias) @ latent -> [b, T·h, d_c] float32: the absorbed
    attention's core, over q_latent [b, T·h, d_c], q_rope [b, T·h, d_r] (float32; token-major), the caches
    [b, cap, d_c] and [b, cap, d_r] as stored (`cache`; an int8 latent with its scales, d_c = `width`) and bias
    [b, 1, T, cap]. `heads` None: one query token per row (the decode graph, and the kernel ops' bodies); else T
    tokens of `heads` heads, token t masked by bias[:, 0, t] (the verify and draft graphs). `scale` None: the queries
    come scaled."""
    latent = read_latent(op, caches.latent, caches.scale, DATA_TYPES[cache.latent], width)
    scores = op.Add(
        op.MatMul(latent, op.Transpose(q_latent, perm=[0, 2, 1])),  # [b, cap, d_c] @ [b, d_c, T·h] -> [b, cap, T·h]
        op.MatMul(
            cast(op, caches.rope, DATA_TYPES[cache.rope], FLOAT), op.Transpose(q_rope, perm=[0, 2, 1])
        ),  # [b, cap, d_r] @ [b, d_r, T·h] -> [b, cap, T·h]
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
        o = op.FusedMatMul(
            latent, probs, transA=1, _domain="com.microsoft"
        )  # [b, cap, d_c]ᵀ @ [b, cap, h] -> [b, d_c, h]
        return op.Transpose(o, perm=[0, 2, 1])  # [b, d_c, h] -> [b, h, d_c]
    logits = op.Add(op.Transpose(logits, perm=[0, 2, 1]), op.Reshape(bias, [0, 1, -1]))  # [b, h, cap] + [b, 1, cap]
    probs = op.Softmax(logits, axis=-1)  # [b, h, cap]
    return op.MatMul(probs, latent)  # [b, h, cap] @ [b, cap, d_c] -> [b, h, d_c]


def latent_attention_op(cache: io_spec.CacheFormat | str, long_cache: bool, chunk: bool = False) -> str:
    """The kernel op's name for these caches: LatentAttention* over float caches (by their dtype), LatentAttentionQ8*
    over an int8 latent (by the rope's dtype); *Long* where the cache can outgrow the long-cache size a row;
    LatentAttentionChunk* / LatentAttentionChunkQ8* for T query tokens a row (a prefill chunk over an int8 latent,
    the verify and draft graphs)."""
    cache = io_spec.CacheFormat.of(cache)
    if chunk:
        return (kernels.LATENT_ATTENTION_CHUNK_Q8[cache.rope] if cache.scaled
                else kernels.LATENT_ATTENTION_CHUNK[cache.latent])
    if cache.scaled:
        return (kernels.LATENT_ATTENTION_LONG_Q8 if long_cache else kernels.LATENT_ATTENTION_Q8)[cache.rope]
    return (kernels.LATENT_ATTENTION_LONG if long_cache else kernels.LATENT_ATTENTION)[cache.latent]


def latent_attention_chunk_core(op, q_latent: ir.Value, q_rope: ir.Value, caches: Caches, bias: ir.Value,
                                cache: io_spec.CacheFormat, width: int) -> ir.Value:
    """softmax(q_latent · latent + q_rope · rope + bias) @ latent for a chunk's queries q_latent [b, T, h, d_c],
    q_rope [b, T, h, d_r] (scaled) over the caches, with each token's bias [b, 1, T, cap] -> [b, T, h, d_c]: the T·h
    queries of a row as the rows of one MatMul per cache row."""
    latent = read_latent(op, caches.latent, caches.scale, DATA_TYPES[cache.latent], width)  # [b, cap, d_c]
    rope_cache = cast(op, caches.rope, DATA_TYPES[cache.rope], FLOAT)
    scores = op.Add(
        op.MatMul(
            op.Reshape(q_latent, op.Concat([0, -1], op.Shape(q_latent, start=3), axis=0)),
            op.Transpose(latent, perm=[0, 2, 1]),
        ),  # [b, T·h, d_c] @ [b, d_c, cap]
        op.MatMul(
            op.Reshape(q_rope, op.Concat([0, -1], op.Shape(q_rope, start=3), axis=0)),
            op.Transpose(rope_cache, perm=[0, 2, 1]),
        ),  # [b, T·h, d_r] @ [b, d_r, cap]
    )  # [b, T·h, cap]
    heads = op.Shape(q_latent, start=0, end=3)  # [b, T, h]
    scores = op.Reshape(scores, op.Concat(heads, [-1], axis=0))  # [b, T, h, cap]
    probs = op.Softmax(op.Add(scores, op.Transpose(bias, perm=[0, 2, 1, 3])), axis=-1)  # + [b, T, 1, cap]
    out = op.MatMul(
        op.Reshape(probs, op.Concat([0, -1], op.Shape(latent, start=1, end=2), axis=0)), latent
    )  # [b, T·h, d_c]
    return op.Reshape(out, op.Shape(q_latent))


def latent_attention_function(cache: io_spec.CacheFormat | str, long_cache: bool, width: int | None = None,
                              chunk: bool = False) -> ir.Function:
    """The body of the kernel op over `cache` (latent_attention_op; an int8 latent's d_c = `width`, DequantizeLinear's
    block; LatentAttentionLong*: a cache that can outgrow the long-cache size a row, multiplied as MatMul's A
    operand; a `chunk`'s queries [b, T, h, ·]): what onnxruntime runs where the kernel library is not registered."""
    cache = io_spec.CacheFormat.of(cache)
    latent, rope = DATA_TYPES[cache.latent], DATA_TYPES[cache.rope]

    if chunk and cache.scaled:
        def body(op, q_latent, q_rope, codes, scale, rope_cache, bias):
            return latent_attention_chunk_core(
                op, q_latent, q_rope, Caches(codes, rope_cache, scale), bias, cache, width
            )

        inputs = {"q_latent": FLOAT, "q_rope": FLOAT, "latent": latent, "latent_scale": FLOAT, "rope": rope,
                  "bias": FLOAT}
        stored = (
            f"an int8 latent cache (DequantizeLinear: codes x their entry's scale) and a {cache.rope} rope cache, "
            "for a chunk's queries [b, T, h, ·] with their bias [b, 1, T, cap]"
        )
    elif chunk:
        def body(op, q_latent, q_rope, latent_cache, rope_cache, bias):
            return latent_attention_chunk_core(op, q_latent, q_rope, Caches(latent_cache, rope_cache), bias, cache,
                                               width)

        inputs = {"q_latent": FLOAT, "q_rope": FLOAT, "latent": latent, "rope": rope, "bias": FLOAT}
        stored = f"{cache.latent} caches, for T query tokens a row [b, T, h, ·] with their bias [b, 1, T, cap]"
    elif cache.scaled:
        def body(op, q_latent, q_rope, codes, scale, rope_cache, bias):
            return latent_attention_core(op, q_latent, q_rope, Caches(codes, rope_cache, scale), bias, cache, width,
                                         long_cache)

        inputs = {"q_latent": FLOAT, "q_rope": FLOAT, "latent": latent, "latent_scale": FLOAT, "rope": rope,
                  "bias": FLOAT}
        stored = f"an int8 latent cache (DequantizeLinear: codes x their entry's scale) and a {cache.rope} rope cache"
    else:
        def body(op, q_latent, q_rope, latent_cache, rope_cache, bias):
            return latent_attention_core(op, q_latent, q_rope, Caches(latent_cache, rope_cache), bias, cache, width,
                                         long_cache)

        inputs = {"q_latent": FLOAT, "q_rope": FLOAT, "latent": latent, "rope": rope, "bias": FLOAT}
        stored = f"{cache.latent} caches"
    return kernel_function(latent_attention_op(cache, long_cache, chunk), inputs, "out", body,
                           f"out = softmax(q_latent · latent + q_rope · rope + bias) @ latent over {stored} "
                           "(the queries already scaled). mla-deploy's kernel library reads the caches as stored and "
                           "only the slots each row sees; this body, where that is not registered, reads every slot"
                           + (", the cache as the A operand" if long_cache and not chunk else ""),
                           opsets={"com.microsoft": 1} if long_cache and not chunk else None)


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
        c_q = RMSNorm(self.g, f"{self.name}.q_a_norm", self.hf + "q_a_layernorm.weight", self.t, cfg.latent_norm_eps)(
            op, c_q
        )
        return c_q, self._hf("q_b_proj.weight")

    def latent_and_rope(self, op, x: ir.Value, cos: ir.Value, sin: ir.Value) -> Caches:
        """x [b, T, d] -> ĉ [b, T, d_c] (normed), k_pe [b, T, d_r] (roped), as the caches store them (an int8 latent:
        codes and their scales)."""
        cfg, g = self.cfg, self.g
        kv = linear(g, op, x, f"{self.name}.kv_a",
                    lambda: absorb.kv_a_weight(cfg, self.t(self.hf + "kv_a_proj_with_mqa.weight")))
        latent, k_pe = op.Split(kv, [cfg.kv_lora_rank, cfg.qk_rope_head_dim], axis=-1, _outputs=2)
        latent = RMSNorm(g, f"{self.name}.kv_norm", self.hf + "kv_a_layernorm.weight", self.t, cfg.latent_norm_eps)(
            op, latent
        )
        k_pe = cast(op, rope(op, g.to_float(op, k_pe), cos, sin, heads=1), FLOAT, g.rope_type)  # one shared key
        if g.plan.cache_format.scaled:
            codes, scale = quantize_latent(op, g.to_float(op, latent))
            return Caches(codes, k_pe, scale)
        return Caches(cast(op, latent, g.compute_type, g.cache_type), k_pe)

    def write_cache(self, op, new: Caches, past: Caches, write_indices) -> Caches:
        """TensorScatter; the graph makes its outputs the present_* outputs themselves: with the output bound to
        the past buffer, onnxruntime updates it in place (an Identity in between would force a copy)."""
        return Caches(op.TensorScatter(past.latent, new.latent, write_indices, axis=-2),  # [b, cap, d_c]
                      op.TensorScatter(past.rope, new.rope, write_indices, axis=-2),  # [b, cap, d_r]
                      None if past.scale is None else op.TensorScatter(past.scale, new.scale, write_indices, axis=-2))

    def naive(self, op, x, cos, sin, bias, past: Caches, write_indices):
        """Prefill: decompress K/V from the whole latent cache, standard attention per head."""
        cfg, g, t = self.cfg, self.g, self.t
        h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q_in, q_weight = self.query_input(op, x)
        q = linear(
            g, op, q_in, f"{self.name}.q", lambda: absorb.query_weight(cfg, q_weight())
        )  # [b, T, h·(d_nope+d_r)]
        q = op.Transpose(
            op.Reshape(g.to_float(op, q), [0, 0, h, dn + dr]), perm=[0, 2, 1, 3]
        )  # -> [b, T, h, ·] -> [b, h, T, d_nope+d_r]
        q_nope, q_pe = op.Split(q, [dn, dr], axis=-1, _outputs=2)
        q_pe = rope(op, q_pe, cos, sin)  # [b, h, T, d_r], cos [b, T, d_r/2]
        present = self.write_cache(op, self.latent_and_rope(op, x, cos, sin), past, write_indices)

        latent = read_latent(op, present.latent, present.scale, g.cache_type, cfg.kv_lora_rank)
        if per_head_quantized(g.plan):  # float32: the decode graph's per-head codes' values, not re-rounded
            kv = linear(g, op, latent, f"{self.name}.kv_b", lambda: t(self.hf + "kv_b_proj.weight").T,
                        quantizable=False, island=True)
        else:
            kv = g.to_float(op, linear(g, op, g.to_compute(op, latent), f"{self.name}.kv_b",
                                       lambda: t(self.hf + "kv_b_proj.weight").T, quantizable=False))
        kv = op.Transpose(
            op.Reshape(kv, [0, 0, h, dn + dv]), perm=[0, 2, 1, 3]
        )  # -> [b, cap, h, ·] -> [b, h, cap, d_nope+d_v]
        k_nope, v = op.Split(kv, [dn, dv], axis=-1, _outputs=2)
        scores = op.Add(
            op.MatMul(q_nope, op.Transpose(k_nope, perm=[0, 1, 3, 2])),  # [b, h, T, cap]
            op.MatMul(
                q_pe, op.Unsqueeze(op.Transpose(cast(op, present.rope, g.rope_type, FLOAT), perm=[0, 2, 1]), [1])
            ),  # k_pe [b, 1, d_r, cap]
        )
        probs = op.Softmax(op.Add(op.Mul(scores, self.scale), bias), axis=-1)
        o = op.Transpose(op.MatMul(probs, v), perm=[0, 2, 1, 3])  # [b, T, h, d_v]
        o = op.Reshape(o, [0, 0, h * dv])  # [b, T, h, d_v] -> [b, T, h·d_v]
        out = linear(g, op, g.to_compute(op, o), f"{self.name}.o", lambda: t(self.hf + "o_proj.weight").T)
        return out, present

    def absorbed(self, op, x, cos, sin, bias, past: Caches, write_indices, tokens: bool = False):
        """The query moves into latent space; attention reads ĉ directly; W^UV after. The decode graph: one token per
        row (T = 1); `tokens`: any number T per row (a prefill chunk over an int8 cache, the verify and draft graphs),
        each seeing the cache up to its own slot. The plan picks the absorbed form (fused or factored), the core
        (mla_deploy.LatentAttention* for one token, LatentAttentionChunkQ8* for T over an int8 cache, or onnxruntime's
        ops) and the long-cache form. Queries run as b·T rows of h heads: [b·T, h, ·] (in decode b·T = b)."""
        cfg, g, plan = self.cfg, self.g, self.g.plan
        h, dn, dr, dc, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                             cfg.kv_lora_rank, cfg.v_head_dim)
        rows = -1 if tokens else 0  # Reshape's leading dim: b·T, or b (decode: T = 1 folds into it)

        def by_token(width: int) -> ir.Value | list[int]:  # the shape [b, T, width] (decode: [b, 1, width])
            return op.Concat(op.Shape(x, start=0, end=2), [width], axis=0) if tokens else [0, 1, width]

        kv_b = self._hf("kv_b_proj.weight")
        q_in, q_weight = self.query_input(op, x)
        if plan.absorb == AbsorbMode.FUSED:  # the product that overflows half precision first: float32
            q_latent = linear(g, op, g.to_float(op, q_in), f"{self.name}.q_uk",
                              lambda: absorb.fused_query_absorb(cfg, q_weight(), kv_b()), island=True)
            q_latent = op.Reshape(q_latent, [rows, h, dc])  # [b, T, h·d_c] -> [b·T, h, d_c]
        else:
            q_nope = linear(g, op, q_in, f"{self.name}.q_nope", lambda: absorb.query_nope_weight(cfg, q_weight()))
            q_nope = op.Reshape(g.to_float(op, q_nope), [rows, h, dn])  # [b, T, h·d_nope] -> [b·T, h, d_nope]
            q_latent = head_linear(g, op, q_nope, f"{self.name}.uk",
                                   lambda: absorb.factored_uk(cfg, kv_b()))  # [b·T, h, d_c]
        q_pe = linear(g, op, q_in, f"{self.name}.q_rope", lambda: absorb.query_rope_weight(cfg, q_weight()))
        q_pe = rope(op, g.to_float(op, q_pe), cos, sin, heads=h)  # [b, T, h·d_r], each token's cos / sin
        q_pe = op.Reshape(q_pe, [rows, h, dr])  # [b, T, h·d_r] -> [b·T, h, d_r]
        present = self.write_cache(op, self.latent_and_rope(op, x, cos, sin), past, write_indices)
        cache = plan.cache_format
        kernel = plan.decode_attention == "kernel"
        if kernel:  # the softmax scale on the queries: h·(d_c + d_r) products, not h·cap
            stored = (present.latent, present.scale, present.rope) if cache.scaled else (present.latent, present.rope)
            q_latent, q_pe = op.Mul(q_latent, self.scale), op.Mul(q_pe, self.scale)
            if tokens:  # the chunk op takes each row's tokens [b, T, h, ·], their causal bias [b, 1, T, cap]
                head_shape = op.Concat(op.Shape(x, start=0, end=2), [h], axis=0)
                q_latent = op.Reshape(q_latent, op.Concat(head_shape, [dc], axis=0))
                q_pe = op.Reshape(q_pe, op.Concat(head_shape, [dr], axis=0))
            o_latent = g.kernel_op(op, latent_attention_op(cache, plan.long_cache, tokens),
                                   lambda: latent_attention_function(cache, plan.long_cache, dc, tokens),
                                   q_latent, q_pe, *stored, bias)  # [b, h, d_c] or [b, T, h, d_c]
        elif tokens:  # the ops over T tokens a row: [b·T, h, ·] -> [b, T·h, ·] (token-major)
            batch = op.Shape(x, start=0, end=1)
            o_latent = latent_attention_core(op, op.Reshape(q_latent, op.Concat(batch, [-1, dc], axis=0)),
                                             op.Reshape(q_pe, op.Concat(batch, [-1, dr], axis=0)), present, bias,
                                             cache, dc, plan.long_cache, self.scale, h)  # [b, T·h, d_c]
        else:
            o_latent = latent_attention_core(op, q_latent, q_pe, present, bias, cache, dc, plan.long_cache,
                                             self.scale)  # [b, h, d_c]
        if tokens:
            o_latent = op.Reshape(o_latent, [-1, h, dc])  # [b, T, h, d_c] or [b, T·h, d_c] -> [b·T, h, d_c]
        o_weight = self._hf("o_proj.weight")
        if plan.absorb == AbsorbMode.FUSED:
            o = op.Reshape(o_latent, by_token(h * dc))  # [b·T, h, d_c] -> [b, T, h·d_c]
            out = g.to_compute(
                op,
                linear(
                    g,
                    op,
                    o,
                    f"{self.name}.uv_o",
                    lambda: absorb.fused_output_absorb(cfg, o_weight(), kv_b()),
                    island=True,
                ),
            )  # [b, T, d]
        else:
            o = head_linear(g, op, o_latent, f"{self.name}.uv",
                            lambda: absorb.factored_uv(cfg, kv_b()))  # [b·T, h, d_c] -> [b·T, h, d_v]
            o = op.Reshape(o, by_token(h * dv))  # [b·T, h, d_v] -> [b, T, h·d_v]
            out = linear(g, op, g.to_compute(op, o), f"{self.name}.o", lambda: o_weight().T)
        return out, present
