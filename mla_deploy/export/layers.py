"""The torch source's modules as ONNX graph code (onnxscript's builder), one class per module of
`mla_deploy/modeling/`: RMSNorm, SwiGLU, MLAttention (naive and absorbed), Router, MoE.

Each module is built over a `Graph` (one graph under construction) and reads its weights by HF name
through `Tensors`; the weights it multiplies by are the pure transforms of `export.absorb`, written once
to the shared weights file by `Graph.weight`. Calling a module (`module(op, x)`) emits its nodes with
`op`, so the same module code serves the main graph and the `If` branches of the experts.

Attention is plain MatMul-Softmax-MatMul: measured 4-8x faster on CPU than the fused Attention /
GroupQueryAttention ops for 576-wide absorbed heads. Caches are written with TensorScatter straight
into the graph outputs, so with IO binding the runtime's buffers are updated in place.

MoE runs only the experts some token chose. Float exports: one `If` per routed expert, whose branch gathers
that expert's tokens, runs its SwiGLU on them and scatter-adds the weighted result; an expert nobody chose
costs one skipped branch and reads none of its weights. Quantized exports: one com.microsoft QMoE per layer
over block-quantized experts, fed the router's own choice and weights. Float layers with few experts per chosen
one run all routed experts in one op, mla_deploy.RoutedExperts (export.experts; each choice measured: README).

Precision (`--dtype`, export.precision): weights and caches are stored in the export's dtype and the layers
compute in its compute dtype (float32 for every dtype on the CPU; a half weight goes through mla_deploy's MatMulF16 /
MatMulBF16, which multiply by it as stored: Graph.half_matmul); RMSNorm statistics, rope, the attention core (absorbed query,
scores, softmax, probs @ latent, the per-head and fused absorbed matrices) and the router run in float32 islands,
entered with `g.to_float` and left with `g.to_compute`.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import numpy as np
import onnx_ir as ir
from onnxscript import GraphBuilder

from .. import io_spec, kernels
from .. import rope as rope_math
from ..config import MLAConfig
from . import absorb
from .absorb import AbsorbMode
from .kernel_functions import half_matmul_function, latent_attention_function, routed_experts_function
from .opset import IR_VERSION, OPSET
from .precision import Precision
from .quantize import Quantization, quantize
from .weights import WeightsFile

Tensors = Callable[[str], np.ndarray]  # HF tensor name -> float32 array
NEG_INF = float(np.finfo(np.float32).min)
FLOAT, BOOL = ir.DataType.FLOAT, ir.DataType.BOOL
# a row's latent cache (float32) at the export's maximum length beyond which decode attention takes the cache as the
# A operand (MLAttention._probs_at_latent): 8192 slots of DeepSeek's 512-wide latent
LONG_CACHE_BYTES = 16 * 2**20
DATA_TYPES = {"int64": ir.DataType.INT64, "float32": FLOAT, "float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}


class Graph:
    """One graph under construction: onnxscript's builder, plus weights by name from the shared file."""

    def __init__(self, name: str, weights: WeightsFile, quantization: Quantization | None = None,
                 experts: str = "branches", precision: Precision = Precision("float32")):
        """`experts`: how MoE layers run their routed experts (export.experts.resolve_experts)."""
        opsets = {"": OPSET, "com.microsoft": 1}  # FusedMatMul in decode attention; QMoE, MoE, MatMulNBits
        self.experts = experts
        self.builder = GraphBuilder(ir.Graph([], [], nodes=[], opset_imports=opsets, name=name))
        self.op = self.builder.op
        self.weights = weights
        self.quantization = quantization
        self.precision = precision
        self.compute_type, self.stored_type = DATA_TYPES[precision.compute], DATA_TYPES[precision.dtype]
        self._values: dict[str, ir.Value] = {}
        self.functions: dict[ir.OperatorIdentifier, ir.Function] = {}  # custom ops' ONNX bodies (mla_deploy.kernels)

    def weight(self, name: str, make: Callable[[], np.ndarray], island: bool = False) -> ir.Value:
        """The weight `name` of this graph in the compute dtype (or float32 for a float32 `island`'s weight); `make`
        runs only if no graph has written it yet. Stored in the export's dtype; where that is not the compute dtype
        (bfloat16 on the CPU) the graph casts it once (onnxruntime folds the cast at load)."""
        if island:
            return self._initializer(name, make, "float32")
        stored = self._initializer(name, make, self.precision.dtype)
        if self.precision.dtype == self.precision.compute:
            return stored
        if f"{name}:compute" not in self._values:
            self._values[f"{name}:compute"] = self.op.Cast(stored, to=self.compute_type)
        return self._values[f"{name}:compute"]

    def half_matmul(self, op, x: ir.Value, name: str, make_w_in_out: Callable[[], np.ndarray]) -> ir.Value:
        """x @ W (x float32) for a half export's weight W [K, N]: mla_deploy.MatMulF16 / MatMulBF16 over W in column
        strips (mla_deploy.kernels: it reads the stored half-precision bytes; onnxruntime's MatMul would read a float32
        copy made at load). A weight whose N is not whole strips goes through MatMul."""
        made = {}

        def w() -> np.ndarray:  # [K, N], made once for its shape and its bytes
            if "w" not in made:
                made["w"] = np.asarray(make_w_in_out())
                self.weights.shapes[name] = made["w"].shape
            return made["w"]

        if name not in self.weights.shapes:
            w()
        if self.weights.shapes[name][1] % kernels.STRIP:
            return op.MatMul(x, self.weight(name, w))
        strips = self._initializer(f"{name}.strips", lambda: kernels.column_strips(w()), self.precision.dtype)
        return self.kernel_op(op, half_matmul_function(self.precision.dtype), x, strips)  # [..., N]

    def routed_experts(self, op, x: ir.Value, dispatch: ir.Value, fc1: tuple[str, Callable[[], np.ndarray]],
                       fc2: tuple[str, Callable[[], np.ndarray]]) -> ir.Value:
        """mla_deploy.RoutedExperts (x [N, d] and dispatch [N, E] float32) -> [N, d] float32 over the strips `fc1`
        and `fc2` (name, make), stored in the export's dtype and read as stored (RoutedExpertsF16 / BF16)."""
        dtype = self.precision.dtype
        weights = [self._initializer(name, make, dtype) for name, make in (fc1, fc2)]
        return self.kernel_op(op, routed_experts_function(dtype), x, dispatch, *weights)

    def latent_attention(self, op, q_latent: ir.Value, q_rope: ir.Value, latent: ir.Value, rope: ir.Value,
                         bias: ir.Value, long: bool = False) -> ir.Value:
        """mla_deploy.LatentAttention (LatentAttentionLong for a `long` cache) over the caches in their stored dtype
        -> [b, h, d_c] float32."""
        function = latent_attention_function(self.precision.dtype, long)
        return self.kernel_op(op, function, q_latent, q_rope, latent, rope, bias)

    def kernel_op(self, op, function: ir.Function, *inputs: ir.Value) -> ir.Value:
        """A node of mla-deploy's kernel library (mla_deploy.kernels), its ONNX body carried by the model. Its output
        is float32, declared here: onnx's shape inference cannot type a body that uses com.microsoft ops."""
        self.functions[function.identifier()] = function
        self.builder.graph.opset_imports[kernels.DOMAIN] = 1
        out = getattr(op, function.name)(*inputs, _domain=kernels.DOMAIN)
        out.dtype = FLOAT
        return out

    def _initializer(self, name: str, make: Callable[[], np.ndarray], dtype: str) -> ir.Value:
        if name not in self._values:
            tensor = self.weights.tensor(name, make, dtype)
            self._values[name] = self.builder.initializer(tensor, name=name, qualify=False)
        return self._values[name]

    @staticmethod
    def cast(op, x: ir.Value, source: ir.DataType, to: ir.DataType) -> ir.Value:
        """x (of dtype `source`) as `to`: no node when they are the same."""
        return x if source == to else op.Cast(x, to=to)

    def to_float(self, op, x: ir.Value) -> ir.Value:
        """Into a float32 island from the compute dtype."""
        return self.cast(op, x, self.compute_type, FLOAT)

    def to_compute(self, op, x: ir.Value) -> ir.Value:
        """Out of a float32 island, back to the compute dtype."""
        return self.cast(op, x, FLOAT, self.compute_type)

    def quantized_weight(self, name: str, make: Callable[[], np.ndarray], bits: int,
                         island: bool = False) -> tuple[ir.Value, ir.Value, int, int]:
        """MatMulNBits' codes and scales for the float weight `make()` [K, N], quantized once; and K, N. Scales in the
        compute dtype, or float32 for a float32 `island`'s MatMulNBits."""
        q = self.quantization
        made = {}

        def quantized():
            if "q" not in made:
                made["q"] = quantize(make(), bits, q.block)
                self.weights.shapes[name] = (made["q"].k, made["q"].n)
            return made["q"]

        codes = self._initializer(f"{name}.codes", lambda: quantized().codes, "uint8")  # [N, k_blocks, B·bits/8]
        scales = self._initializer(f"{name}.scales", lambda: quantized().scales,
                                   "float32" if island else self.precision.compute)  # [N, k_blocks]
        return (codes, scales, *self.weights.shapes[name])

    def weight_view(self, name: str, of: str, shape: tuple[int, ...]) -> ir.Value:
        """The written weight `of` reshaped to `shape` as the initializer `name`: the same bytes in weights.bin."""
        if name not in self._values:
            self._values[name] = self.builder.initializer(self.weights.view(name, of, shape), name=name, qualify=False)
        return self._values[name]

    def embedding(self, ids: ir.Value, make_vocab_by_d: Callable[[], np.ndarray]) -> ir.Value:
        """ids [b, T] -> rows [b, T, d] of the embedding; quantized, GatherBlockQuantized over the codes a tied head's
        MatMulNBits reads too (the quantized weight `embed` is Eᵀ [d, V]: one code row per token, blocks along d)."""
        q = self.quantization
        if q is None:  # rows gathered in the stored dtype, then cast: a bfloat16 table is never widened whole
            rows = self.op.Gather(self._initializer("embed", make_vocab_by_d, self.precision.dtype), ids, axis=0)  # [b, T, d]
            return rows if self.stored_type == self.compute_type else self.op.Cast(rows, to=self.compute_type)
        bits = q.head_bits
        _, scales, d, vocab = self.quantized_weight("embed", lambda: make_vocab_by_d().T, bits)
        rows = self.weight_view("embed.rows", "embed.codes", (vocab, (d + -d % q.block) * bits // 8))  # [V, k_blocks·blob]
        return self.op.GatherBlockQuantized(rows, ids, scales, gather_axis=0, quantize_axis=1, block_size=q.block,
                                            bits=bits, _domain="com.microsoft")  # [b, T, d]

    def input(self, spec: io_spec.TensorSpec) -> ir.Value:
        return self.builder.input(spec.name, DATA_TYPES[spec.dtype], list(spec.shape))

    def output(self, value: ir.Value, spec: io_spec.TensorSpec) -> None:
        """`value` becomes the graph output `spec.name` itself (renamed, no Identity in between)."""
        self.builder.add_output(value, spec.name)
        value.dtype = DATA_TYPES[spec.dtype]
        value.shape = ir.Shape(list(spec.shape))

    @contextlib.contextmanager
    def scope(self, name: str):
        """Node names under `name` (layers.3.attn/...): readable profiles and graph viewers."""
        self.builder.push_module(name)
        try:
            yield
        finally:
            self.builder.pop_module()

    def model(self, metadata: dict[str, str]) -> ir.Model:
        return ir.Model(self.builder.graph, ir_version=IR_VERSION, producer_name="mla-deploy",
                        producer_version=metadata.get("mla_deploy_version", ""), metadata_props=dict(metadata),
                        functions=list(self.functions.values()))


# ---- small pieces ----
class RMSNorm:
    def __init__(self, g: Graph, name: str, hf_weight: str, t: Tensors, eps: float):
        self.g, self.name, self.hf_weight, self.t, self.eps = g, name, hf_weight, t, eps

    def __call__(self, op, x: ir.Value) -> ir.Value:
        """Statistics and scaling in float32 whatever the export's dtype (a half-precision sum of squares overflows)."""
        weight = self.g.weight(self.name, lambda: self.t(self.hf_weight), island=True)
        return self.g.to_compute(op, op.RMSNormalization(self.g.to_float(op, x), weight, axis=-1, epsilon=self.eps))


def linear(g: Graph, op, x: ir.Value, name: str, make_w_in_out: Callable[[], np.ndarray], quantizable: bool = True,
           head: bool = False, island: bool = False) -> ir.Value:
    """x @ W with W stored [in, out]; through MatMulNBits when the export quantizes (the vocabulary `head` at
    head_bits). Weights that are a column subset or permutation of an HF weight's transpose are quantized like it
    (export.quantize.DequantizedCheckpoint); the fused absorbed products after absorption (DequantizedCheckpoint.
    absorbed_matrices); kv_b and the router are not `quantizable`. In a float32 `island` x is float32 and so are W
    or the quantization scales."""
    q = g.quantization
    if (q is None or not quantizable) and g.precision.dtype in kernels.HALF_MATMUL and not island:
        return g.half_matmul(op, x, name, make_w_in_out)
    if q is None or not quantizable:
        return op.MatMul(x, g.weight(name, make_w_in_out, island=island))
    bits = q.head_bits if head else q.bits
    codes, scales, k, n = g.quantized_weight(name, make_w_in_out, bits, island=island)
    return op.MatMulNBits(x, codes, scales, K=k, N=n, bits=bits, block_size=q.block, accuracy_level=q.accuracy_level,
                          _domain="com.microsoft")


class SwiGLU:
    """down(silu(gate(x)) · up(x)), gate and up in one [d, 2·inter] matmul."""

    def __init__(self, g: Graph, name: str, hf: str, t: Tensors, inter: int):
        self.g, self.name, self.hf, self.t, self.inter = g, name, hf, t, inter

    def __call__(self, op, x: ir.Value) -> ir.Value:
        t, hf = self.t, self.hf
        gu = linear(self.g, op, x, f"{self.name}.gate_up",
                    lambda: absorb.gate_up_weight(t(hf + "gate_proj.weight"), t(hf + "up_proj.weight")))  # [..., 2·inter]
        gate, up = op.Split(gu, [self.inter, self.inter], axis=-1, _outputs=2)
        hidden = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)  # silu(gate)·up
        return linear(self.g, op, hidden, f"{self.name}.down", lambda: t(hf + "down_proj.weight").T)  # [..., d]


def rope(op, x: ir.Value, cos: ir.Value, sin: ir.Value) -> ir.Value:
    """Rotate halves: x [..., d_r], cos/sin broadcastable to [..., d_r/2]."""
    x1, x2 = op.Split(x, axis=-1, num_outputs=2, _outputs=2)  # [..., d_r/2] each
    return op.Concat(op.Sub(op.Mul(x1, cos), op.Mul(x2, sin)), op.Add(op.Mul(x2, cos), op.Mul(x1, sin)), axis=-1)


def rope_lookup(g: Graph, cfg: MLAConfig, position_ids: ir.Value, max_len: int) -> tuple[ir.Value, ir.Value]:
    """position_ids [b, T] -> cos, sin [b, T, d_r/2] (float32: rope runs in the attention's float32 island) from
    tables of max_len positions."""
    op = g.op
    tables = functools.cache(lambda: rope_math.rope_tables(cfg, max_len))  # computed once for both
    cos = g.weight("rope.cos", lambda: tables()[0], island=True)  # [max_len, d_r/2]
    sin = g.weight("rope.sin", lambda: tables()[1], island=True)
    return op.Gather(cos, position_ids, axis=0), op.Gather(sin, position_ids, axis=0)


def attention_bias(op, input_ids: ir.Value, attention_mask: ir.Value, write_indices: ir.Value) -> ir.Value:
    """Additive mask [b, 1, T, cap]: 0 where query t (at slot write_indices + t) sees slot j, else float32 min."""
    seq = op.Gather(op.Shape(input_ids), 1, axis=0)  # T
    cap = op.Gather(op.Shape(attention_mask), 1, axis=0)  # capacity
    query_slot = op.Add(op.Unsqueeze(write_indices, [1]), op.Range(0, seq, 1))  # [b, T]
    causal = op.LessOrEqual(op.Range(0, cap, 1), op.Unsqueeze(query_slot, [2]))  # [cap] vs [b, T, 1] -> [b, T, cap]
    valid = op.Cast(op.Unsqueeze(attention_mask, [1]), to=BOOL)  # [b, 1, cap]
    bias = op.Where(op.And(causal, valid), 0.0, NEG_INF)  # [b, T, cap]
    return op.Unsqueeze(bias, [1])  # [b, 1, T, cap]


# ---- attention (modeling/attention.py) ----
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
        return g.cast(op, latent, g.compute_type, g.stored_type), g.cast(op, k_pe, FLOAT, g.stored_type)

    def cached(self, op, cache: ir.Value) -> ir.Value:
        """A cache (stored dtype) as the attention core's float32 operand."""
        return self.g.cast(op, cache, self.g.stored_type, FLOAT)

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

        kv = linear(g, op, g.cast(op, cache_latent, g.stored_type, g.compute_type), f"{self.name}.kv_b",
                    lambda: t(self.hf + "kv_b_proj.weight").T, quantizable=False)  # [b, cap, h·(d_nope+d_v)]
        kv = op.Transpose(op.Reshape(g.to_float(op, kv), [0, 0, h, dn + dv]), perm=[0, 2, 1, 3])  # -> [b, cap, h, ·] -> [b, h, cap, d_nope+d_v]
        k_nope, v = op.Split(kv, [dn, dv], axis=-1, _outputs=2)
        scores = op.Add(
            op.MatMul(q_nope, op.Transpose(k_nope, perm=[0, 1, 3, 2])),  # [b, h, T, cap]
            op.MatMul(q_pe, op.Unsqueeze(op.Transpose(self.cached(op, cache_rope), perm=[0, 2, 1]), [1])),  # k_pe [b, 1, d_r, cap]
        )
        probs = op.Softmax(op.Add(op.Mul(scores, self.scale), bias), axis=-1)
        o = op.Transpose(op.MatMul(probs, v), perm=[0, 2, 1, 3])  # [b, T, h, d_v]
        o = op.Reshape(o, [0, 0, h * dv])  # [b, T, h, d_v] -> [b, T, h·d_v]
        out = linear(g, op, g.to_compute(op, o), f"{self.name}.o", lambda: t(self.hf + "o_proj.weight").T)
        return out, cache_latent, cache_rope

    def _probs_at_latent(self, op, logits, bias, latent, long_cache: bool) -> ir.Value:
        """softmax(logits [b, cap, h] + bias [b, 1, 1, cap]) over the cache, times latent [b, cap, d_c] -> [b, h, d_c].
        MLAS packs a MatMul's B operand on every call; for a cache that can outgrow LONG_CACHE_BYTES per row, packing
        it costs as much as the product, so such a cache is the A operand (FusedMatMul transA); a short one stays B,
        where the plain MatMul is faster (README, Versus llama.cpp). Chosen at export from the maximum length: an If
        on the capacity measured no better on the demo, within this machine's noise. The short path adds the bias
        after the transpose: broadcast over heads it is one row of cap floats per head, where in [b, cap, h] it is
        one float per h-wide row (onnxruntime's Add: 120 vs ~15 us per layer at batch 16 on the demo)."""
        if long_cache:
            logits = op.Add(logits, op.Reshape(bias, [0, -1, 1]))  # [b, 1, 1, cap] -> [b, cap, 1]
            probs = op.Softmax(logits, axis=1)  # [b, cap, h]
            o = op.FusedMatMul(latent, probs, transA=1, _domain="com.microsoft")  # [b, cap, d_c]ᵀ @ [b, cap, h] -> [b, d_c, h]
            return op.Transpose(o, perm=[0, 2, 1])  # [b, d_c, h] -> [b, h, d_c]
        logits = op.Add(op.Transpose(logits, perm=[0, 2, 1]), op.Reshape(bias, [0, 1, -1]))  # [b, h, cap] + [b, 1, cap]
        probs = op.Softmax(logits, axis=-1)  # [b, h, cap]
        return op.MatMul(probs, latent)  # [b, h, cap] @ [b, cap, d_c] -> [b, h, d_c]

    def absorbed(self, op, x, cos, sin, bias, past_latent, past_rope, write_indices, mode: AbsorbMode,
                 long_cache: bool = False, attention: str = "ops"):
        """Decode (T = 1): the query moves into latent space; attention reads ĉ directly; W^UV after. `long_cache`:
        the cache may grow past LONG_CACHE_BYTES per row (_probs_at_latent). `attention`: the core in
        mla_deploy.LatentAttention ("kernel") or in onnxruntime's ops ("ops"; export.decode_attention)."""
        cfg, g = self.cfg, self.g
        h, dn, dr, dc, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                             cfg.kv_lora_rank, cfg.v_head_dim)
        kv_b = self._hf("kv_b_proj.weight")
        q_in, q_weight = self.query_input(op, x)
        if mode == AbsorbMode.FUSED:  # the product that overflows half precision first: float32
            q_latent = linear(g, op, g.to_float(op, q_in), f"{self.name}.q_uk",
                              lambda: absorb.fused_query_absorb(cfg, q_weight(), kv_b()), island=True)
            q_latent = op.Reshape(q_latent, [0, h, dc])  # [b, 1, h·d_c] -> [b, h, d_c]
        else:
            q_nope = linear(g, op, q_in, f"{self.name}.q_nope", lambda: absorb.query_nope_weight(cfg, q_weight()))
            q_nope = op.Transpose(op.Reshape(g.to_float(op, q_nope), [0, h, dn]), perm=[1, 0, 2])  # [b, 1, h·d_nope] -> [b, h, d_nope] -> [h, b, d_nope]
            uk = g.weight(f"{self.name}.uk", lambda: absorb.factored_uk(cfg, kv_b()), island=True)
            q_latent = op.Transpose(op.MatMul(q_nope, uk), perm=[1, 0, 2])  # [h, b, d_c] -> [b, h, d_c]
        q_pe = linear(g, op, q_in, f"{self.name}.q_rope", lambda: absorb.query_rope_weight(cfg, q_weight()))
        q_pe = op.Reshape(g.to_float(op, q_pe), [0, h, dr])  # [b, 1, h·d_r] -> [b, h, d_r]
        q_pe = rope(op, q_pe, cos, sin)  # cos [b, 1, d_r/2] broadcasts over heads
        latent, k_pe = self.latent_and_rope(op, x, cos, sin)
        cache_latent, cache_rope = self.write_cache(op, latent, k_pe, past_latent, past_rope, write_indices)
        if attention == "kernel":  # the softmax scale on the queries: h·(d_c + d_r) products, not h·cap
            o_latent = g.latent_attention(op, op.Mul(q_latent, self.scale), op.Mul(q_pe, self.scale), cache_latent,
                                          cache_rope, bias, long_cache)  # [b, h, d_c]
        else:
            latent_f = self.cached(op, cache_latent)
            scores = op.Add(
                op.MatMul(latent_f, op.Transpose(q_latent, perm=[0, 2, 1])),  # [b, cap, d_c] @ [b, d_c, h] -> [b, cap, h]
                op.MatMul(self.cached(op, cache_rope), op.Transpose(q_pe, perm=[0, 2, 1])),  # [b, cap, d_r] @ [b, d_r, h] -> [b, cap, h]
            )
            o_latent = self._probs_at_latent(op, op.Mul(scores, self.scale), bias, latent_f, long_cache)  # [b, h, d_c]
        o_weight = self._hf("o_proj.weight")
        if mode == AbsorbMode.FUSED:
            o = op.Reshape(o_latent, [0, 1, h * dc])  # [b, h, d_c] -> [b, 1, h·d_c]
            out = g.to_compute(op, linear(g, op, o, f"{self.name}.uv_o",
                                          lambda: absorb.fused_output_absorb(cfg, o_weight(), kv_b()), island=True))  # [b, 1, d]
        else:
            o_latent = op.Transpose(o_latent, perm=[1, 0, 2])  # [b, h, d_c] -> [h, b, d_c]
            uv = g.weight(f"{self.name}.uv", lambda: absorb.factored_uv(cfg, kv_b()), island=True)
            o = op.MatMul(o_latent, uv)  # [h, b, d_v]
            o = op.Reshape(op.Transpose(o, perm=[1, 0, 2]), [0, 1, h * dv])  # [h, b, d_v] -> [b, h, d_v] -> [b, 1, h·d_v]
            out = linear(g, op, g.to_compute(op, o), f"{self.name}.o", lambda: o_weight().T)
        return out, cache_latent, cache_rope


# ---- mixture of experts (modeling/moe.py) ----
class Router:
    """x2 [N, d] -> expert indices [N, k] int64, weights [N, k] float32 (the math: modeling/moe.py), in a float32
    island: near-tied expert scores must choose as the source does."""

    def __init__(self, g: Graph, cfg: MLAConfig, t: Tensors, hf: str, name: str):
        self.g, self.cfg, self.t, self.hf, self.name = g, cfg, t, hf, name

    def __call__(self, op, x2: ir.Value) -> tuple[ir.Value, ir.Value]:
        cfg, g, t, hf = self.cfg, self.g, self.t, self.hf
        router = g.weight(f"{self.name}.router", lambda: t(hf + "gate.weight").T, island=True)
        logits = op.MatMul(g.to_float(op, x2), router)  # [N, E]
        k = [cfg.num_experts_per_tok]
        if cfg.scoring_func == "sigmoid":
            scores = op.Sigmoid(logits)
            choice = op.Add(scores, g.weight(f"{self.name}.score_bias", lambda: t(hf + "gate.e_score_correction_bias"),
                                             island=True))
            top2, _ = op.TopK(self._grouped(op, choice), [2], axis=-1, _outputs=2)  # [N, G, 2]
            group_scores = op.ReduceSum(top2, [-1], keepdims=0)  # [N, G]
            choice = op.Where(self._group_mask(op, group_scores), choice, float("-inf"))
            _, idx = op.TopK(choice, k, axis=-1, _outputs=2)
            weights = op.GatherElements(scores, idx, axis=1)  # [N, k]: the bias only chooses
            if cfg.norm_topk_prob:
                weights = op.Div(weights, op.Add(op.ReduceSum(weights, [-1], keepdims=1), 1e-20))
        else:
            scores = op.Softmax(logits, axis=-1)
            if cfg.topk_method == "group_limited_greedy":
                group_scores = op.ReduceMax(self._grouped(op, scores), [-1], keepdims=0)  # [N, G]
                scores = op.Where(self._group_mask(op, group_scores), scores, 0.0)
            weights, idx = op.TopK(scores, k, axis=-1, _outputs=2)
        return idx, op.Mul(weights, float(cfg.routed_scaling_factor))

    def _grouped(self, op, scores: ir.Value) -> ir.Value:
        cfg = self.cfg
        return op.Reshape(scores, [0, cfg.n_group, cfg.n_routed_experts // cfg.n_group])  # [N, E] -> [N, G, E/G]

    def _group_mask(self, op, group_scores: ir.Value) -> ir.Value:
        """[N, G] -> [N, E] bool: experts in the topk_group best groups."""
        cfg = self.cfg
        _, top = op.TopK(group_scores, [cfg.topk_group], axis=-1, _outputs=2)  # [N, topk_group]
        hit = op.Equal(op.Unsqueeze(top, [-1]), op.Range(0, cfg.n_group, 1))  # [N, topk_group, G]
        keep = op.ReduceMax(op.Cast(hit, to=FLOAT), [1], keepdims=0)  # [N, G]
        per_group = cfg.n_routed_experts // cfg.n_group
        keep = op.Expand(op.Unsqueeze(keep, [-1]), [1, 1, per_group])  # [N, G] -> [N, G, 1] -> [N, G, E/G]
        return op.Cast(op.Reshape(keep, [0, cfg.n_routed_experts]), to=BOOL)  # [N, G, E/G] -> [N, E] bool


class MoE:
    """Shared experts on every token; routed experts, each behind an If, on the tokens that chose it."""

    def __init__(self, g: Graph, cfg: MLAConfig, t: Tensors, layer: int):
        self.g, self.cfg, self.t, self.layer = g, cfg, t, layer
        self.hf, self.name = f"model.layers.{layer}.mlp.", f"layers.{layer}.moe"

    def __call__(self, op, x: ir.Value) -> ir.Value:
        cfg, g, t, hf = self.cfg, self.g, self.t, self.hf
        shape = op.Shape(x)
        x2 = op.Reshape(x, [-1, cfg.hidden_size])  # [b, T, d] -> [N, d]
        idx, weights = Router(g, cfg, t, hf, self.name)(op, x2)
        onehot = op.Cast(op.Equal(op.Unsqueeze(idx, [-1]), op.Range(0, cfg.n_routed_experts, 1)), to=FLOAT)  # [N, k, E]
        dispatch = op.ReduceSum(op.Mul(onehot, op.Unsqueeze(weights, [-1])), [1], keepdims=0)  # [N, E]
        chosen = op.ReduceMax(onehot, [1], keepdims=0)  # [N, E] 1.0 where the token chose the expert
        dispatch_c = g.to_compute(op, dispatch)  # mixes the experts' outputs, in the compute dtype
        shared = None
        if cfg.n_shared_experts:
            shared = SwiGLU(g, f"{self.name}.shared", hf + "shared_experts.", t,
                            cfg.moe_intermediate_size * cfg.n_shared_experts)(op, x2)
        if self.g.experts in ("qmoe", "kernel"):
            if self.g.experts == "qmoe":
                routed = self._qmoe(op, x2, g.to_compute(op, chosen), dispatch_c)
            else:
                routed = self._kernel(op, x2, dispatch)
            out = routed if shared is None else op.Add(shared, routed)
        else:
            active = op.Greater(op.ReduceSum(chosen, [0], keepdims=0), 0.0)  # [E]
            flags = op.Split(active, axis=0, num_outputs=cfg.n_routed_experts, _outputs=cfg.n_routed_experts)
            flags = flags if isinstance(flags, (list, tuple)) else [flags]
            # accumulated in float32: onnxruntime's CPU ScatterND has no float16 reduction (and the sum is better for it)
            out = g.to_float(op, op.Mul(x2, 0.0) if shared is None else shared)
            for e, flag in enumerate(flags):
                out = self._expert(op, e, flag, x2, chosen, dispatch, out)
            out = g.to_compute(op, out)
        return op.Reshape(out, shape)  # [N, d] -> [b, T, d]

    def _fused_expert_weight(self, kind: str, e: int) -> np.ndarray:
        """Routed expert e's weight in the MoE ops' SwiGLU layout, as a MatMul B [K, N]: "fc1" gate and up [d, 2I]
        with their columns interleaved (swiglu_fusion 1), "fc2" down [I, d]."""
        w = f"{self.hf}experts.{e}."
        if kind == "fc1":
            return absorb.gate_up_interleaved(self.t(w + "gate_proj.weight"), self.t(w + "up_proj.weight"))
        return self.t(w + "down_proj.weight").T

    def _kernel(self, op, x2, dispatch) -> ir.Value:
        """All routed experts in one mla_deploy.RoutedExperts, weighted by DeepSeek's own dispatch (float32): each
        expert multiplies only the tokens that chose it, reading its strips as stored (float32, float16, bfloat16)."""
        cfg, g, t, hf = self.cfg, self.g, self.t, self.hf

        def fc1() -> np.ndarray:  # [E, I'/32, d, 64]
            return np.stack([kernels.expert_fc1_strips(t(f"{hf}experts.{e}.gate_proj.weight"),
                                                       t(f"{hf}experts.{e}.up_proj.weight"))
                             for e in range(cfg.n_routed_experts)])

        def fc2() -> np.ndarray:  # [E, d'/64, I', 64]
            return np.stack([kernels.expert_fc2_strips(t(f"{hf}experts.{e}.down_proj.weight"))
                             for e in range(cfg.n_routed_experts)])

        routed = g.routed_experts(op, g.to_float(op, x2), dispatch, (f"{self.name}.experts.fc1.strips", fc1),
                                  (f"{self.name}.experts.fc2.strips", fc2))  # [N, d] float32
        return g.to_compute(op, routed)

    def _qmoe(self, op, x2, chosen, dispatch) -> ir.Value:
        """All routed experts in one com.microsoft QMoE: it selects by `router_probs` (the router's choice, 1.0 on
        the k chosen experts, 0.0 elsewhere) and mixes by `router_weights` (the router's weights, already scaled),
        so DeepSeek's own routing (groups, V3's selection-only bias) decides, not the op's softmax. SwiGLU with
        alpha 1 and beta 0 is silu(gate) · up; fc1 rows interleave gate and up (swiglu_fusion 1)."""
        cfg, g, q = self.cfg, self.g, self.g.quantization
        made: dict[str, list] = {}

        def experts(kind: str) -> list:
            """Per expert, its fc1 or fc2 weight quantized: computed once for codes and scales."""
            if kind not in made:
                made[kind] = [quantize(self._fused_expert_weight(kind, e), q.bits, q.block)
                              for e in range(cfg.n_routed_experts)]
            return made[kind]

        def codes(kind: str) -> np.ndarray:  # [E, N, K·bits/8]: MatMulNBits' [N, k_blocks, blob] per expert, flattened
            return np.stack([e.codes.reshape(e.n, -1) for e in experts(kind)])

        def scales(kind: str) -> np.ndarray:  # [E, N, k_blocks]
            scale = np.stack([e.scales for e in experts(kind)])
            made.pop(kind)  # codes were written first: the quantized experts can go
            return scale

        fc1 = g.weight(f"{self.name}.experts.fc1.codes", lambda: codes("fc1"))  # [E, 2I, d·bits/8]
        fc1_scales = g.weight(f"{self.name}.experts.fc1.scales", lambda: scales("fc1"))  # [E, 2I, d/block]
        fc2 = g.weight(f"{self.name}.experts.fc2.codes", lambda: codes("fc2"))  # [E, d, I·bits/8]
        fc2_scales = g.weight(f"{self.name}.experts.fc2.scales", lambda: scales("fc2"))  # [E, d, I/block]
        return op.QMoE(x2, chosen, fc1, fc1_scales, None, fc2, fc2_scales, None, None, None, None, None, None, None,
                       dispatch, k=cfg.num_experts_per_tok, activation_type="swiglu", swiglu_fusion=1,
                       activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=0,
                       expert_weight_bits=q.bits, block_size=q.block, accuracy_level=q.accuracy_level,
                       _domain="com.microsoft")  # [N, d]

    def _expert(self, op, e: int, flag, x2, chosen, dispatch, acc) -> ir.Value:
        """acc + weight · expert_e(x) on the rows that chose expert e, inside If(expert e chosen by any row); `acc`
        and the weighted outputs are float32."""
        cfg = self.cfg
        expert = SwiGLU(self.g, f"{self.name}.experts.{e}", f"{self.hf}experts.{e}.", self.t, cfg.moe_intermediate_size)

        def run(op):
            column = op.Squeeze(op.Gather(chosen, [e], axis=1), [1])  # [N]
            rows = op.Reshape(op.NonZero(column), [-1])  # [1, n_e] -> [n_e]
            y = self.g.to_float(op, expert(op, op.Gather(x2, rows, axis=0)))  # [n_e, d]
            w = op.Gather(op.Squeeze(op.Gather(dispatch, [e], axis=1), [1]), rows, axis=0)  # [n_e]
            y = op.Mul(y, op.Unsqueeze(w, [-1]))
            return op.ScatterND(acc, op.Unsqueeze(rows, [-1]), y, reduction="add")  # [N, d]

        def skip(op):
            return op.Identity(acc)

        out_type = dict(type=ir.TensorType(FLOAT), shape=ir.Shape(["N", cfg.hidden_size]))
        then_branch = self.g.builder.subgraph(run, [], [ir.Value(name=f"{self.name}.expert{e}.out", **out_type)],
                                              name=f"{self.name}.expert{e}")
        else_branch = self.g.builder.subgraph(skip, [], [ir.Value(name=f"{self.name}.skip{e}.out", **out_type)],
                                              name=f"{self.name}.skip{e}")
        return op.If(flag, then_branch=then_branch, else_branch=else_branch)
