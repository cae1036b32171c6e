"""The model's pieces as ONNX subgraphs, over HF weights transformed by mla_deploy.export.absorb.

Attention is plain MatMul-Softmax-MatMul: measured 4-8x faster on CPU than the fused Attention /
GroupQueryAttention ops for 576-wide absorbed heads. Caches are updated with TensorScatter, so
with IO binding the runtime's buffers are written in place.

MoE runs only the experts some token chose: one `If` per routed expert, whose branch gathers that
expert's tokens, runs its SwiGLU on them and scatter-adds the weighted result. An expert nobody
chose costs one skipped branch and reads none of its weights.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import io_spec
from .. import rope as rope_math
from ..config import MLAConfig
from . import absorb
from .absorb import AbsorbMode
from .onnx_builder import GraphBuilder

Tensors = Callable[[str], np.ndarray]  # HF tensor name -> float32 array
NEG_INF = float(np.finfo(np.float32).min)


# ---- small pieces ----
def rms_norm(g: GraphBuilder, x: str, weight_name: str, weight: np.ndarray, eps: float) -> str:
    return g.RMSNormalization(x, g.weight(weight_name, weight), axis=-1, epsilon=eps)


def linear(g: GraphBuilder, x: str, name: str, w_in_out: np.ndarray) -> str:
    return g.MatMul(x, g.weight(name, w_in_out))


def swiglu(g: GraphBuilder, x: str, prefix: str, gate_up: np.ndarray, down: np.ndarray) -> str:
    gu = linear(g, x, f"{prefix}.gate_up", gate_up)  # [..., 2·inter]
    gate, up = g.op("Split", gu, g.const([down.shape[0], down.shape[0]]), outputs=2, axis=-1)
    return linear(g, g.Mul(g.Mul(gate, g.Sigmoid(gate)), up), f"{prefix}.down", down)  # silu(gate)·up -> [..., d]


def hf_swiglu(g: GraphBuilder, x: str, prefix: str, t: Tensors, hf_prefix: str) -> str:
    gate_up = absorb.gate_up_weight(t(hf_prefix + "gate_proj.weight"), t(hf_prefix + "up_proj.weight"))
    return swiglu(g, x, prefix, gate_up, t(hf_prefix + "down_proj.weight").T)


def rope(g: GraphBuilder, x: str, cos: str, sin: str) -> str:
    """Rotate halves: x [..., d_r], cos/sin broadcastable to [..., d_r/2]."""
    x1, x2 = g.op("Split", x, outputs=2, axis=-1, num_outputs=2)  # [..., d_r/2] each
    return g.Concat(g.Sub(g.Mul(x1, cos), g.Mul(x2, sin)), g.Add(g.Mul(x2, cos), g.Mul(x1, sin)), axis=-1)


def rope_lookup(g: GraphBuilder, cfg: MLAConfig, position_ids: str, max_len: int) -> tuple[str, str]:
    """position_ids [b, T] -> cos, sin [b, T, d_r/2] from tables of max_len positions."""
    cos, sin = rope_math.rope_tables(cfg, max_len)
    return g.Gather(g.weight("rope.cos", cos), position_ids, axis=0), g.Gather(g.weight("rope.sin", sin), position_ids, axis=0)


def attention_bias(g: GraphBuilder, input_ids: str, attention_mask: str, write_indices: str) -> str:
    """Additive mask [b, 1, T, cap]: 0 where query t (at slot write_indices + t) sees slot j, else float32 min."""
    zero, one = g.const(0), g.const(1)
    seq = g.Gather(g.Shape(input_ids), one, axis=0)  # T
    cap = g.Gather(g.Shape(attention_mask), one, axis=0)  # capacity
    query_slot = g.Add(g.Unsqueeze(write_indices, g.const([1])), g.Range(zero, seq, one))  # [b, T]
    slots = g.Range(zero, cap, one)  # [cap]
    causal = g.LessOrEqual(slots, g.Unsqueeze(query_slot, g.const([2])))  # [b, T, cap]
    valid = g.Cast(g.Unsqueeze(attention_mask, g.const([1])), to=9)  # [b, 1, cap] bool
    visible = g.And(causal, valid)
    bias = g.Where(visible, g.const(0.0, np.float32), g.const(NEG_INF, np.float32))  # [b, T, cap]
    return g.Unsqueeze(bias, g.const([1]))  # [b, 1, T, cap]


# ---- attention ----
class AttentionBuilder:
    """One layer's MLA in ONNX: shared projections, then the naive (prefill) or absorbed (decode) core."""

    def __init__(self, g: GraphBuilder, cfg: MLAConfig, t: Tensors, layer: int):
        self.g, self.cfg, self.t, self.layer = g, cfg, t, layer
        self.hf = f"model.layers.{layer}.self_attn."
        self.name = f"layers.{layer}.attn"
        self.scale = rope_math.softmax_scale(cfg)

    def query_input(self, x: str) -> tuple[str, np.ndarray]:
        """x, or c_q = q_norm(W^DQ x) with q LoRA; and the HF weight that maps it to per-head queries."""
        cfg, g, t = self.cfg, self.g, self.t
        if cfg.q_lora_rank is None:
            return x, t(self.hf + "q_proj.weight")
        c_q = linear(g, x, f"{self.name}.q_a", t(self.hf + "q_a_proj.weight").T)
        c_q = rms_norm(g, c_q, f"{self.name}.q_a_norm", t(self.hf + "q_a_layernorm.weight"), cfg.rms_norm_eps)
        return c_q, t(self.hf + "q_b_proj.weight")

    def latent_and_rope(self, x: str, cos: str, sin: str) -> tuple[str, str]:
        """x [b, T, d] -> ĉ [b, T, d_c] (normed), k_pe [b, T, d_r] (roped)."""
        cfg, g, t = self.cfg, self.g, self.t
        kv = linear(g, x, f"{self.name}.kv_a", absorb.kv_a_weight(cfg, t(self.hf + "kv_a_proj_with_mqa.weight")))
        latent, k_pe = g.op("Split", kv, g.const([cfg.kv_lora_rank, cfg.qk_rope_head_dim]), outputs=2, axis=-1)
        latent = rms_norm(g, latent, f"{self.name}.kv_norm", t(self.hf + "kv_a_layernorm.weight"), cfg.rms_norm_eps)
        return latent, rope(g, k_pe, cos, sin)

    def write_cache(self, latent, k_pe, past_latent, past_rope, write_indices) -> tuple[str, str]:
        """TensorScatter straight into the present_* graph outputs: with the output bound to the past buffer,
        onnxruntime updates it in place (an Identity in between would force a copy of the whole cache)."""
        g, i = self.g, self.layer
        return (g.op("TensorScatter", past_latent, latent, write_indices, axis=-2,
                     out_names=[io_spec.present_latent(i)]),  # [b, cap, d_c]
                g.op("TensorScatter", past_rope, k_pe, write_indices, axis=-2,
                     out_names=[io_spec.present_rope(i)]))  # [b, cap, d_r]

    def naive(self, x, cos, sin, bias, past_latent, past_rope, write_indices):
        """Prefill: decompress K/V from the whole latent cache, standard attention per head."""
        cfg, g, t = self.cfg, self.g, self.t
        h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        q_in, q_weight = self.query_input(x)
        q = linear(g, q_in, f"{self.name}.q", absorb.query_weight(cfg, q_weight))  # [b, T, h·(d_nope+d_r)]
        q = g.Transpose(g.Reshape(q, g.const([0, 0, h, dn + dr])), perm=[0, 2, 1, 3])  # [b, h, T, d_nope+d_r]
        q_nope, q_pe = g.op("Split", q, g.const([dn, dr]), outputs=2, axis=-1)
        q_pe = rope(g, q_pe, g.Unsqueeze(cos, g.const([1])), g.Unsqueeze(sin, g.const([1])))  # cos [b, 1, T, d_r/2]
        latent, k_pe = self.latent_and_rope(x, cos, sin)
        cache_latent, cache_rope = self.write_cache(latent, k_pe, past_latent, past_rope, write_indices)

        kv = linear(g, cache_latent, f"{self.name}.kv_b", t(self.hf + "kv_b_proj.weight").T)  # [b, cap, h·(d_nope+d_v)]
        kv = g.Transpose(g.Reshape(kv, g.const([0, 0, h, dn + dv])), perm=[0, 2, 1, 3])  # [b, h, cap, d_nope+d_v]
        k_nope, v = g.op("Split", kv, g.const([dn, dv]), outputs=2, axis=-1)
        scores = g.Add(
            g.MatMul(q_nope, g.Transpose(k_nope, perm=[0, 1, 3, 2])),  # [b, h, T, cap]
            g.MatMul(q_pe, g.Unsqueeze(g.Transpose(cache_rope, perm=[0, 2, 1]), g.const([1]))),  # k_pe [b, 1, d_r, cap]
        )
        probs = g.Softmax(g.Add(g.Mul(scores, g.const(self.scale, np.float32)), bias), axis=-1)
        o = g.Transpose(g.MatMul(probs, v), perm=[0, 2, 1, 3])  # [b, T, h, d_v]
        o = g.Reshape(o, g.const([0, 0, h * dv]))  # [b, T, h·d_v]
        return linear(g, o, f"{self.name}.o", t(self.hf + "o_proj.weight").T), cache_latent, cache_rope

    def absorbed(self, x, cos, sin, bias, past_latent, past_rope, write_indices, mode: AbsorbMode):
        """Decode (T = 1): the query moves into latent space; attention reads ĉ directly; W^UV after."""
        cfg, g, t = self.cfg, self.g, self.t
        h, dn, dr, dc, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                             cfg.kv_lora_rank, cfg.v_head_dim)
        kv_b = t(self.hf + "kv_b_proj.weight")
        q_in, q_weight = self.query_input(x)
        if mode == AbsorbMode.FUSED:
            q_latent = linear(g, q_in, f"{self.name}.q_uk", absorb.fused_query_absorb(cfg, q_weight, kv_b))
            q_latent = g.Reshape(q_latent, g.const([0, h, dc]))  # [b, 1, h·d_c] -> [b, h, d_c]
        else:
            q_nope = linear(g, q_in, f"{self.name}.q_nope", absorb.query_nope_weight(cfg, q_weight))
            q_nope = g.Transpose(g.Reshape(q_nope, g.const([0, h, dn])), perm=[1, 0, 2])  # [h, b, d_nope]
            q_latent = g.MatMul(q_nope, g.weight(f"{self.name}.uk", absorb.factored_uk(cfg, kv_b)))  # [h, b, d_c]
            q_latent = g.Transpose(q_latent, perm=[1, 0, 2])  # [b, h, d_c]
        q_pe = linear(g, q_in, f"{self.name}.q_rope", absorb.query_rope_weight(cfg, q_weight))
        q_pe = g.Reshape(q_pe, g.const([0, h, dr]))  # [b, 1, h·d_r] -> [b, h, d_r]
        q_pe = rope(g, q_pe, cos, sin)  # cos [b, 1, d_r/2] broadcasts over heads
        latent, k_pe = self.latent_and_rope(x, cos, sin)
        cache_latent, cache_rope = self.write_cache(latent, k_pe, past_latent, past_rope, write_indices)

        scores = g.Add(
            g.MatMul(cache_latent, g.Transpose(q_latent, perm=[0, 2, 1])),  # [b, cap, d_c] @ [b, d_c, h] -> [b, cap, h]
            g.MatMul(cache_rope, g.Transpose(q_pe, perm=[0, 2, 1])),  # [b, cap, d_r] @ [b, d_r, h] -> [b, cap, h]
        )
        scores = g.Transpose(scores, perm=[0, 2, 1])  # [b, h, cap]
        decode_bias = g.Squeeze(bias, g.const([1]))  # [b, 1, 1, cap] -> [b, 1, cap]
        probs = g.Softmax(g.Add(g.Mul(scores, g.const(self.scale, np.float32)), decode_bias), axis=-1)
        o_latent = g.MatMul(probs, cache_latent)  # [b, h, cap] @ [b, cap, d_c] -> [b, h, d_c]
        o_weight = t(self.hf + "o_proj.weight")
        if mode == AbsorbMode.FUSED:
            o = g.Reshape(o_latent, g.const([0, 1, h * dc]))  # [b, 1, h·d_c]
            out = linear(g, o, f"{self.name}.uv_o", absorb.fused_output_absorb(cfg, o_weight, kv_b))
        else:
            o_latent = g.Transpose(o_latent, perm=[1, 0, 2])  # [b, h, d_c] -> [h, b, d_c]
            o = g.MatMul(o_latent, g.weight(f"{self.name}.uv", absorb.factored_uv(cfg, kv_b)))  # [h, b, d_v]
            o = g.Reshape(g.Transpose(o, perm=[1, 0, 2]), g.const([0, 1, h * dv]))  # [h, b, d_v] -> [b, 1, h·d_v]
            out = linear(g, o, f"{self.name}.o", o_weight.T)
        return out, cache_latent, cache_rope


# ---- mixture of experts ----
def route(g: GraphBuilder, cfg: MLAConfig, x2: str, t: Tensors, hf: str, name: str) -> tuple[str, str]:
    """x2 [N, d] -> expert indices [N, k] int64, weights [N, k] float32 (see modeling/moe.py for the math)."""
    logits = linear(g, x2, f"{name}.router", t(hf + "gate.weight").T)  # [N, E]
    k = g.const([cfg.num_experts_per_tok])
    if cfg.scoring_func == "sigmoid":
        scores = g.Sigmoid(logits)
        choice = g.Add(scores, g.weight(f"{name}.score_bias", t(hf + "gate.e_score_correction_bias")))
        top2 = g.op("TopK", grouped(g, cfg, choice), g.const([2]), outputs=2, axis=-1)[0]  # [N, G, 2]
        group_scores = g.ReduceSum(top2, g.const([-1]), keepdims=0)  # [N, G]
        choice = g.Where(group_mask(g, cfg, group_scores), choice, g.const(float("-inf"), np.float32))
        _, idx = g.op("TopK", choice, k, outputs=2, axis=-1)
        weights = g.GatherElements(scores, idx, axis=1)  # [N, k]
        if cfg.norm_topk_prob:
            denominator = g.Add(g.ReduceSum(weights, g.const([-1]), keepdims=1), g.const(1e-20, np.float32))
            weights = g.Div(weights, denominator)
    else:
        scores = g.Softmax(logits, axis=-1)
        if cfg.topk_method == "group_limited_greedy":
            group_scores = g.ReduceMax(grouped(g, cfg, scores), g.const([-1]), keepdims=0)  # [N, G]
            scores = g.Where(group_mask(g, cfg, group_scores), scores, g.const(0.0, np.float32))
        weights, idx = g.op("TopK", scores, k, outputs=2, axis=-1)
    return idx, g.Mul(weights, g.const(cfg.routed_scaling_factor, np.float32))


def grouped(g: GraphBuilder, cfg: MLAConfig, scores: str) -> str:
    return g.Reshape(scores, g.const([0, cfg.n_group, cfg.n_routed_experts // cfg.n_group]))  # [N, E] -> [N, G, E/G]


def group_mask(g: GraphBuilder, cfg: MLAConfig, group_scores: str) -> str:
    """[N, G] -> [N, E] bool: experts in the topk_group best groups."""
    _, top = g.op("TopK", group_scores, g.const([cfg.topk_group]), outputs=2, axis=-1)  # [N, topk_group]
    hit = g.Equal(g.Unsqueeze(top, g.const([-1])), g.const(np.arange(cfg.n_group)))  # [N, topk_group, G]
    keep = g.ReduceMax(g.Cast(hit, to=1), g.const([1]), keepdims=0)  # [N, G]
    per_group = cfg.n_routed_experts // cfg.n_group
    keep = g.Expand(g.Unsqueeze(keep, g.const([-1])), g.const([1, 1, per_group]))  # [N, G, E/G]
    return g.Cast(g.Reshape(keep, g.const([0, cfg.n_routed_experts])), to=9)  # [N, E] bool


def moe(g: GraphBuilder, cfg: MLAConfig, x: str, t: Tensors, layer: int) -> str:
    hf, name = f"model.layers.{layer}.mlp.", f"layers.{layer}.moe"
    shape = g.Shape(x)
    x2 = g.Reshape(x, g.const([-1, cfg.hidden_size]))  # [b, T, d] -> [N, d]
    idx, weights = route(g, cfg, x2, t, hf, name)
    onehot = g.Cast(g.Equal(g.Unsqueeze(idx, g.const([-1])), g.const(np.arange(cfg.n_routed_experts))), to=1)  # [N, k, E]
    dispatch = g.ReduceSum(g.Mul(onehot, g.Unsqueeze(weights, g.const([-1]))), g.const([1]), keepdims=0)  # [N, E]
    chosen = g.ReduceMax(onehot, g.const([1]), keepdims=0)  # [N, E] 1.0 where the token chose the expert
    active = g.Greater(g.ReduceSum(chosen, g.const([0]), keepdims=0), g.const(0.0, np.float32))  # [E]
    flags = g.op("Split", active, outputs=cfg.n_routed_experts, axis=0, num_outputs=cfg.n_routed_experts)
    flags = flags if isinstance(flags, list) else [flags]

    out = hf_swiglu(g, x2, f"{name}.shared", t, hf + "shared_experts.") if cfg.n_shared_experts else g.Mul(x2, g.const(0.0, np.float32))
    for e, flag in enumerate(flags):
        out = expert_branch(g, cfg, e, flag, x2, chosen, dispatch, out, t, hf, name)
    return g.Reshape(out, shape)  # [N, d] -> [b, T, d]


def expert_branch(g, cfg, e, flag, x2, chosen, dispatch, acc, t, hf, name) -> str:
    """acc + weight · expert_e(x) on the rows that chose expert e, inside If(expert e chosen by any row)."""
    then = g.branch(f"expert{e}")
    col = then.const([e])
    rows = then.Reshape(then.NonZero(then.Squeeze(then.Gather(chosen, col, axis=1), then.const([1]))), then.const([-1]))  # [n_e]
    y = hf_swiglu(then, then.Gather(x2, rows, axis=0), f"{name}.experts.{e}", t, f"{hf}experts.{e}.")  # [n_e, d]
    w = then.Gather(then.Squeeze(then.Gather(dispatch, col, axis=1), then.const([1])), rows, axis=0)  # [n_e]
    y = then.Mul(y, then.Unsqueeze(w, then.const([-1])))
    new = then.ScatterND(acc, then.Unsqueeze(rows, then.const([-1])), y, reduction="add")  # [N, d]
    then.output(new, then.fresh("out"), "float32", ["N", cfg.hidden_size])
    orelse = g.branch(f"skip{e}")
    orelse.output(orelse.Identity(acc), orelse.fresh("out"), "float32", ["N", cfg.hidden_size])
    return g.If(flag, then_branch=then.to_graph(), else_branch=orelse.to_graph())
