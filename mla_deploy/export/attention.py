"""modeling/attention.py as graph code: one layer's MLA over the latent and rope caches written in place, absorbed in
the decode and verify graphs, and in the prefill graph naive or absorbed, whichever costs a call fewer multiply-adds
for its T tokens over the slots they see (ChunkCosts: one If per layer on a condition computed once); and the
absorbed attention core, which the graphs run in onnxruntime's ops or in mla_deploy.LatentAttention*, whose ONNX
bodies are the same cores (`latent_attention_function`).

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


def first_slots(op, caches: Caches, slots: ir.Value) -> Caches:
    """The caches' first `slots` slots, [b, slots, ·]."""
    return Caches(*(None if c is None else op.Slice(c, [0], slots, [1]) for c in caches))


class ChunkCosts(NamedTuple):
    """Multiply-adds per head of a prefill chunk of T tokens over the `slots` cache slots its queries see, in each
    form (the projections both forms share left out):
        naive     slots · d_c · (d_nope + d_v)       decompressing the slots through kv_b
                  + T · slots · (d_nope + d_r + d_v)  scores and probs @ V per head
        absorbed  T · slots · (2 d_c + d_r)          scores and probs @ ĉ over the latent
                  + T · per_token                    each query into latent space and its output out of it, beyond
                                                     the naive projections: factored d_c · (d_nope + d_v); fused,
                                                     whose matrices are wider, d_q · (d_c - d_nope) + d · (d_c - d_v)
    The absorbed form is the cheaper one for few tokens over many slots (a chat turn after a cached history, a chunk
    of a long prompt), with DeepSeek's widths the naive one for a prompt from an empty cache (T = slots)."""

    per_slot: int  # naive: slots · per_slot + T · slots · naive_pair
    naive_pair: int
    absorbed_pair: int  # absorbed: T · slots · absorbed_pair + T · per_token
    per_token: int

    @classmethod
    def of(cls, cfg: MLAConfig, absorb_mode: AbsorbMode) -> "ChunkCosts":
        dc, dn, dr, dv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if absorb_mode == AbsorbMode.FUSED:
            d_q = cfg.q_lora_rank or cfg.hidden_size
            per_token = d_q * (dc - dn) + cfg.hidden_size * (dc - dv)
        else:
            per_token = dc * (dn + dv)
        return cls(dc * (dn + dv), dn + dr + dv, 2 * dc + dr, per_token)

    def absorbed_is_cheaper(self, tokens: int, slots: int) -> bool:
        """The rule the prefill graph's If evaluates (ChunkForm), for the reference and the tests."""
        return tokens * (slots * self.absorbed_pair + self.per_token) < slots * (self.per_slot + tokens *
                                                                                 self.naive_pair)


class ChunkForm(NamedTuple):
    """A prefill call's attention form, decided once for every layer: whether the absorbed form is the cheaper
    (ChunkCosts), the slots its queries see (max(write_indices) + T: every later slot is masked for every row, so an
    attention that reads every slot it is given reads these first ones only) and the bias cut to them."""

    absorbed: ir.Value | None  # bool [1]; None: naive always
    slots: ir.Value  # int64 [1]
    visible_bias: ir.Value  # [b, 1, T, slots]

    @classmethod
    def build(cls, op, costs: ChunkCosts | None, input_ids: ir.Value, write_indices: ir.Value,
              bias: ir.Value) -> "ChunkForm":
        """ChunkCosts.absorbed_is_cheaper in int64, as exact as the Python rule (`costs` None: naive always)."""
        t = op.Shape(input_ids, start=1, end=2)  # [T]
        slots = op.Add(op.ReduceMax(write_indices, keepdims=1), t)
        visible_bias = op.Slice(bias, [0], slots, [3])
        if costs is None:
            return cls(None, slots, visible_bias)
        absorbed = op.Mul(t, op.Add(op.Mul(slots, costs.absorbed_pair), costs.per_token))
        naive = op.Mul(slots, op.Add(op.Mul(t, costs.naive_pair), costs.per_slot))
        return cls(op.Less(absorbed, naive), slots, visible_bias)


def latent_attention_core(op, q_latent: ir.Value, q_rope: ir.Value, caches: Caches, bias: ir.Value,
                          cache: io_spec.CacheFormat, width: int, long_cache: bool, scale: float | None = None):
    """softmax(scale · (q_latent · latent + q_rope · rope) + bias) @ latent -> [b, h, d_c] float32: the absorbed
    attention's core for one query token a row, over q_latent [b, h, d_c], q_rope [b, h, d_r] (float32), the caches
    [b, cap, d_c] and [b, cap, d_r] as stored (`cache`; an int8 latent with its scales, d_c = `width`) and bias
    [b, 1, 1, cap] (the decode graph, and the kernel ops' bodies; T tokens a row: latent_attention_chunk_core).
    `scale` None: the queries come scaled."""
    latent = read_latent(op, caches.latent, caches.scale, DATA_TYPES[cache.latent], width)
    scores = op.Add(
        op.MatMul(latent, op.Transpose(q_latent, perm=[0, 2, 1])),  # [b, cap, d_c] @ [b, d_c, h] -> [b, cap, h]
        op.MatMul(
            cast(op, caches.rope, DATA_TYPES[cache.rope], FLOAT), op.Transpose(q_rope, perm=[0, 2, 1])
        ),  # [b, cap, d_r] @ [b, d_r, h] -> [b, cap, h]
    )
    if scale is not None:
        scores = op.Mul(scores, scale)
    return probs_at_latent(op, scores, bias, latent, long_cache)


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


def latent_attention_op(cache: io_spec.CacheFormat | str, long_cache: bool, chunk: bool = False,
                        avx512: bool = False) -> str:
    """The kernel op's name for these caches: LatentAttention* over float caches (by their dtype), LatentAttentionQ8*
    over an int8 latent (by the rope's dtype); *Long* where the cache can outgrow the long-cache size a row;
    LatentAttentionChunk* / LatentAttentionChunkQ8* for T query tokens a row (a prefill chunk over an int8 latent,
    the verify and draft graphs); `avx512` (float32 caches): the names registered only where the kernels run AVX-512
    code."""
    cache = io_spec.CacheFormat.of(cache)
    if avx512:
        if cache.latent != "float32" or cache.rope != "float32":
            raise ValueError(f"the AVX-512-only attention ops take float32 caches, not {cache}")
        return kernels.LATENT_ATTENTION_CHUNK_AVX512 if chunk else kernels.LATENT_ATTENTION_AVX512[long_cache]
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
                              chunk: bool = False, avx512: bool = False) -> ir.Function:
    """The body of the kernel op over `cache` (latent_attention_op; an int8 latent's d_c = `width`, DequantizeLinear's
    block; LatentAttentionLong*: a cache that can outgrow the long-cache size a row, multiplied as MatMul's A
    operand; a `chunk`'s queries [b, T, h, ·]; `avx512`: the op registered only on AVX-512 CPUs): what onnxruntime
    runs where the kernel library does not register the op."""
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
    return kernel_function(latent_attention_op(cache, long_cache, chunk, avx512), inputs, "out", body,
                           f"out = softmax(q_latent · latent + q_rope · rope + bias) @ latent over {stored} "
                           "(the queries already scaled). mla-deploy's kernel library reads the caches as stored and "
                           "only the slots each row sees; this body, where that is not registered, reads every slot"
                           + (", the cache as the A operand" if long_cache and not chunk else ""),
                           opsets={"com.microsoft": 1} if long_cache and not chunk else None)


class MLAttention:
    """One layer's MLA: the new cache entries written, then the naive or the absorbed core (their query and output
    projections their own)."""

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

    def naive_core(self, op, x, cos, sin, bias, present: Caches, slots):
        """Decompress K/V from the cache's first `slots` slots (ChunkForm: those some query sees; bias
        [b, 1, T, slots] cut to them), standard attention per head. Reading the whole capacity instead would cost
        every chunk the decompression of slots no query sees: a row's capacity is the longest row's."""
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
        seen = first_slots(op, present, slots)
        latent = read_latent(op, seen.latent, seen.scale, g.cache_type, cfg.kv_lora_rank)
        if per_head_quantized(g.plan):  # float32: the decode graph's per-head codes' values, not re-rounded
            kv = linear(g, op, latent, f"{self.name}.kv_b", lambda: t(self.hf + "kv_b_proj.weight").T,
                        quantizable=False, island=True)
        else:
            kv = g.to_float(op, linear(g, op, g.to_compute(op, latent), f"{self.name}.kv_b",
                                       lambda: t(self.hf + "kv_b_proj.weight").T, quantizable=False))
        kv = op.Transpose(
            op.Reshape(kv, [0, 0, h, dn + dv]), perm=[0, 2, 1, 3]
        )  # -> [b, slots, h, ·] -> [b, h, slots, d_nope+d_v]
        k_nope, v = op.Split(kv, [dn, dv], axis=-1, _outputs=2)
        scores = op.Add(
            op.MatMul(q_nope, op.Transpose(k_nope, perm=[0, 1, 3, 2])),  # [b, h, T, slots]
            op.MatMul(
                q_pe, op.Unsqueeze(op.Transpose(cast(op, seen.rope, g.rope_type, FLOAT), perm=[0, 2, 1]), [1])
            ),  # k_pe [b, 1, d_r, slots]
        )
        probs = op.Softmax(op.Add(op.Mul(scores, self.scale), bias), axis=-1)
        o = op.Transpose(op.MatMul(probs, v), perm=[0, 2, 1, 3])  # [b, T, h, d_v]
        o = op.Reshape(o, [0, 0, h * dv])  # [b, T, h, d_v] -> [b, T, h·d_v]
        return linear(g, op, g.to_compute(op, o), f"{self.name}.o", lambda: t(self.hf + "o_proj.weight").T)

    def absorbed(self, op, x, cos, sin, bias, past: Caches, write_indices, tokens: bool = False):
        """The new entries written, then absorbed_core."""
        present = self.write_cache(op, self.latent_and_rope(op, x, cos, sin), past, write_indices)
        return self.absorbed_core(op, x, cos, sin, bias, present, tokens), present

    def naive(self, op, x, cos, sin, chunk: "ChunkForm", past: Caches, write_indices):
        """Prefill in the naive form always: the new entries written, then naive_core."""
        present = self.write_cache(op, self.latent_and_rope(op, x, cos, sin), past, write_indices)
        return self.naive_core(op, x, cos, sin, chunk.visible_bias, present, chunk.slots), present

    def per_chunk(self, op, x, cos, sin, chunk: "ChunkForm", past: Caches, write_indices):
        """Prefill: the new entries written, then If(chunk.absorbed, absorbed_core, naive_core) (ChunkCosts: the
        cheaper form for this call's T tokens and visible slots); both branches read the written caches' visible
        slots only (the chunk kernel op would skip the others itself, but not its ONNX body, which runs where the
        library is not registered: CUDA)."""
        present = self.write_cache(op, self.latent_and_rope(op, x, cos, sin), past, write_indices)

        def absorbed(op):
            seen = first_slots(op, present, chunk.slots)
            return self.absorbed_core(op, x, cos, sin, chunk.visible_bias, seen, tokens=True)

        def naive(op):
            return self.naive_core(op, x, cos, sin, chunk.visible_bias, present, chunk.slots)

        out_type = dict(type=ir.TensorType(self.g.compute_type), shape=ir.Shape(["batch", "seq", self.cfg.hidden_size]))
        branches = []
        for form, run in (("absorbed", absorbed), ("naive", naive)):
            with self.g.scope(form):  # each branch's values named apart (one graph's names are unique)
                branches.append(self.g.builder.subgraph(
                    run, [], [ir.Value(name=f"{self.name}.{form}.out", **out_type)], name=f"{self.name}.{form}"
                ))
        then_branch, else_branch = branches
        return op.If(chunk.absorbed, then_branch=then_branch, else_branch=else_branch), present

    def absorbed_core(self, op, x, cos, sin, bias, present: Caches, tokens: bool = False):
        """The query moves into latent space; attention reads ĉ directly; W^UV after. The decode graph: one token per
        row (T = 1); `tokens`: any number T per row (the verify and draft graphs, and a prefill call that takes this
        form), each seeing the cache up to its own slot. The plan picks the absorbed form (fused or
        factored), the core (mla_deploy.LatentAttention* for one token, LatentAttentionChunk* /
        LatentAttentionChunkQ8* for T, under "avx512" their *Avx512 names but in the prefill graph, or onnxruntime's
        ops: latent_attention_core for one token, latent_attention_chunk_core for T) and the long-cache form (one
        token). Queries run as b·T rows of h heads: [b·T, h, ·] (in decode b·T = b). The kernel ops read only the
        slots each row sees; their ONNX bodies, where the library is not registered (CUDA), every slot of
        `present`."""
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
        cache = plan.cache_format
        # "avx512": the kernel for the decode, verify and draft graphs; a prefill chunk (T up to the chunk length)
        # runs onnxruntime's ops, whose one MatMul of a row's T·h queries is ahead at long chunks (at 17 tokens over
        # 16k slots by 8 %, docs/benchmarks.md)
        avx512 = plan.decode_attention == "avx512" and g.kind != io_spec.PREFILL
        kernel = plan.decode_attention == "kernel" or avx512
        if kernel or tokens:  # the softmax scale on the queries: h·(d_c + d_r) products, not h·cap
            q_latent, q_pe = op.Mul(q_latent, self.scale), op.Mul(q_pe, self.scale)
        if tokens:  # each row's tokens [b, T, h, ·], with their causal bias [b, 1, T, cap]
            head_shape = op.Concat(op.Shape(x, start=0, end=2), [h], axis=0)
            q_latent = op.Reshape(q_latent, op.Concat(head_shape, [dc], axis=0))
            q_pe = op.Reshape(q_pe, op.Concat(head_shape, [dr], axis=0))
        if kernel:
            stored = (present.latent, present.scale, present.rope) if cache.scaled else (present.latent, present.rope)
            o_latent = g.kernel_op(op, latent_attention_op(cache, plan.long_cache, tokens, avx512),
                                   lambda: latent_attention_function(cache, plan.long_cache, dc, tokens, avx512),
                                   q_latent, q_pe, *stored, bias)  # [b, h, d_c] or [b, T, h, d_c]
        elif tokens:  # the kernel op's ONNX body: the T·h queries of a row as the rows of one MatMul, the softmax
            # along the last axis (over [b, cap, T, h] along the cache's axis it took 80 ms of a full-size V2-Lite
            # layer's 143 for 128 tokens over 2128 slots)
            o_latent = latent_attention_chunk_core(op, q_latent, q_pe, present, bias, cache, dc)  # [b, T, h, d_c]
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
        return out
