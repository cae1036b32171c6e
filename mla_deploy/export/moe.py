"""modeling/moe.py as graph code: the dense SwiGLU, the V2 / V3 routers, and MoE layers whose routed experts run in
the form the plan chose (export.plan): one mla_deploy.RoutedExperts, or QRoutedExperts over block-quantized experts
("kernel"), one com.microsoft QMoE ("qmoe") or MoE ("moe"), or one If per expert ("branches"), whose branch gathers
that expert's tokens, runs its SwiGLU on them and scatter-adds the weighted result, so an expert nobody chose costs
one skipped branch and reads none of its weights. The kernels' ONNX bodies, every expert on every token weighted by the
dispatch, are built from this file's graph code (`every_expert`: `routed_experts_function`,
`qrouted_experts_function`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .. import kernels
from ..config import MLAConfig
from . import absorb, layouts
from .builder import BOOL, DATA_TYPES, FLOAT, Graph, Tensors, attribute, cast, kernel_function
from .dequantize import dequantized_weight, quantized_activations
from .layouts import COLUMNS
from .linear import FLOAT16, UINT8, linear


def silu_mul(op, gate: ir.Value, up: ir.Value) -> ir.Value:
    """silu(gate) · up."""
    return op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)


class SwiGLU:
    """down(silu(gate(x)) · up(x)), gate and up in one [d, 2·inter] matmul."""

    def __init__(self, g: Graph, name: str, hf: str, t: Tensors, inter: int):
        self.g, self.name, self.hf, self.t, self.inter = g, name, hf, t, inter

    def __call__(self, op, x: ir.Value) -> ir.Value:
        t, hf = self.t, self.hf
        gu = linear(
            self.g,
            op,
            x,
            f"{self.name}.gate_up",
            lambda: absorb.gate_up_weight(t(hf + "gate_proj.weight"), t(hf + "up_proj.weight")),
        )  # [..., 2·inter]
        gate, up = op.Split(gu, [self.inter, self.inter], axis=-1, _outputs=2)
        return linear(self.g, op, silu_mul(op, gate, up), f"{self.name}.down",
                      lambda: t(hf + "down_proj.weight").T)  # [..., d]


def every_expert(op, x: ir.Value, dispatch: ir.Value, gate: ir.Value, up: ir.Value, down: ir.Value, d: ir.Value,
                 into_down=lambda hidden: hidden) -> ir.Value:
    """sum_e dispatch[:, e] · down_e(silu(gate_e x) · up_e x) -> [T, d] float32, every expert on every token: x
    [T, K] and dispatch [T, E] float32, gate and up [E, K, I'], down [E, I', d'] (K, I' and d' zero-padded beyond d,
    I and d), d [1]; `into_down` is what the hidden activations [E, T, I'] pass through before down."""
    hidden = into_down(silu_mul(op, op.MatMul(x, gate), op.MatMul(x, up)))  # [T, K] @ [E, K, I'] -> [E, T, I']
    y = op.MatMul(hidden, down)  # [E, T, d']
    weights = op.Unsqueeze(op.Transpose(dispatch, perm=[1, 0]), [-1])  # [T, E] -> [E, T] -> [E, T, 1]
    y = op.ReduceSum(op.Mul(y, weights), [0], keepdims=0)  # [T, d']
    return op.Slice(y, [0], d, [1])  # [T, d'] -> [T, d]


def routed_experts_dense(op, x: ir.Value, dispatch: ir.Value, fc1: ir.Value, fc2: ir.Value,
                         weight_type: ir.DataType) -> ir.Value:
    """every_expert over fc1 [E, I'/32, d, 64] and fc2 [E, d'/64, I', 64] as RoutedExperts stores them
    (mla_deploy.kernels.expert_fc1_strips / expert_fc2_strips) in `weight_type`; x [T, d]."""
    fc1, fc2 = cast(op, fc1, weight_type, FLOAT), cast(op, fc2, weight_type, FLOAT)
    gate_up = op.Reshape(op.Transpose(fc1, perm=[0, 2, 1, 3]),
                         [0, 0, 0, 2, kernels.GATE_UP])  # [E, J, d, 64] -> [E, d, J, 64] -> [E, d, J, 2, 32]
    gate = op.Reshape(op.Gather(gate_up, 0, axis=3), [0, 0, -1])  # [E, d, J, 32] -> [E, d, I']
    up = op.Reshape(op.Gather(gate_up, 1, axis=3), [0, 0, -1])  # [E, d, I']
    down = op.Reshape(
        op.Transpose(fc2, perm=[0, 2, 1, 3]), [0, 0, -1]
    )  # [E, S, I', 64] -> [E, I', S, 64] -> [E, I', d']
    return every_expert(op, x, dispatch, gate, up, down, op.Shape(x, start=1))


def qrouted_experts_dense(op, x: ir.Value, dispatch: ir.Value, fc1_codes: ir.Value, fc1_scales: ir.Value,
                          fc2_codes: ir.Value, fc2_scales: ir.Value, bits: int) -> ir.Value:
    """every_expert over int`bits` experts in the kernels' layout (export.layouts.routed_experts_layout: fc1's
    16-column groups alternate gate and up); block_size and accuracy_level are the calling node's attributes: at 4,
    x and the hidden activations are quantized per block first, as the kernel quantizes them."""
    block, level = attribute(op, "block_size"), attribute(op, "accuracy_level")
    k1, k2 = (op.Mul(op.Shape(codes, start=2, end=3), block) for codes in (fc1_codes, fc2_codes))  # [1]: KB·B
    pairs = op.Reshape(dequantized_weight(op, fc1_codes, fc1_scales, bits, lead=1),
                       [0, 0, -1, 2, COLUMNS])  # [E, K1_pad, 2 I'] -> [E, K1_pad, I'/16, 2, 16]
    gate = op.Reshape(op.Gather(pairs, 0, axis=3), [0, 0, -1])  # [E, K1_pad, I']
    up = op.Reshape(op.Gather(pairs, 1, axis=3), [0, 0, -1])
    down = dequantized_weight(op, fc2_codes, fc2_scales, bits, lead=1)  # [E, K2_pad, d']
    return every_expert(op, quantized_activations(op, x, k1, block, level, rank=2), dispatch, gate, up, down,
                        op.Shape(x, start=1),
                        lambda hidden: quantized_activations(op, hidden, k2, block, level, rank=3))


def routed_experts_function(dtype: str) -> ir.Function:
    """The body of mla_deploy.RoutedExperts for `dtype` weights (float32, float16, bfloat16): what onnxruntime runs
    where the kernel library is not registered."""
    weight = DATA_TYPES[dtype]

    def body(op, x, dispatch, fc1, fc2):
        return routed_experts_dense(op, x, dispatch, fc1, fc2, weight)

    return kernel_function(kernels.ROUTED_EXPERTS[dtype], {"X": FLOAT, "dispatch": FLOAT, "fc1": weight, "fc2": weight},
                           "Y", body,
                           f"Y = sum_e dispatch[:, e] · down_e(silu(gate_e X) · up_e X) over {dtype} fc1 [E, I'/32, d, "
                           "64] and fc2 [E, d'/64, I', 64] (mla_deploy.kernels.expert_fc1_strips / expert_fc2_strips). "
                           "mla-deploy's kernel library runs only each expert's own tokens; this body, where that is "
                           "not registered, runs every expert on every token (weights re-laid out and folded at load).")


def qrouted_experts_function(bits: int) -> ir.Function:
    """The body of mla_deploy.QRoutedExperts4 / QRoutedExperts8: what onnxruntime runs where the kernel library is
    not registered."""
    inputs = {"X": FLOAT, "dispatch": FLOAT, "fc1_codes": UINT8, "fc1_scales": FLOAT16, "fc2_codes": UINT8,
              "fc2_scales": FLOAT16}
    return kernel_function(kernels.QROUTED_EXPERTS[bits], inputs, "Y",
                           lambda op, *args: qrouted_experts_dense(op, *args, bits),
                           f"Y = sum_e dispatch[:, e] · down_e(silu(gate_e X) · up_e X) over int{bits} experts in "
                           "mla-deploy's quantized layout (export.layouts.routed_experts_layout). The kernel library "
                           "runs only each expert's own tokens, reading only their codes; this body, where that is not "
                           "registered, runs every expert on every token (weights dequantized and folded at load).",
                           attributes={"block_size": None, "accuracy_level": 0})


# ---- the router and the MoE layer ----
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
    """Shared experts on every token; routed experts in the plan's form (module docstring)."""

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
        shared = None
        if cfg.n_shared_experts:
            shared = SwiGLU(g, f"{self.name}.shared", hf + "shared_experts.", t,
                            cfg.moe_intermediate_size * cfg.n_shared_experts)(op, x2)
        if g.plan.experts in ("qmoe", "moe", "kernel"):
            if g.plan.experts == "qmoe":  # chosen and the weights that mix the experts' outputs in the compute dtype
                routed = self._qmoe(op, x2, g.to_compute(op, chosen), g.to_compute(op, dispatch))
            elif g.plan.experts == "moe":
                routed = self._moe(op, x2, dispatch)
            else:
                routed = self._kernel(op, x2, dispatch)
            out = routed if shared is None else op.Add(shared, routed)
        else:
            active = op.Greater(op.ReduceSum(chosen, [0], keepdims=0), 0.0)  # [E]
            flags = op.Split(active, axis=0, num_outputs=cfg.n_routed_experts, _outputs=cfg.n_routed_experts)
            flags = flags if isinstance(flags, (list, tuple)) else [flags]
            # accumulated in float32: onnxruntime's CPU ScatterND has no float16 reduction (and the sum is better
            # for it)
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
        expert multiplies only the tokens that chose it, reading its strips as stored (float32, float16, bfloat16);
        QRoutedExperts for quantized experts."""
        cfg, g, t, hf = self.cfg, self.g, self.t, self.hf
        if g.plan.quantization is not None:
            return self._quantized_kernel(op, x2, dispatch)

        def fc1() -> np.ndarray:  # [E, I'/32, d, 64]
            return np.stack([kernels.expert_fc1_strips(t(f"{hf}experts.{e}.gate_proj.weight"),
                                                       t(f"{hf}experts.{e}.up_proj.weight"))
                             for e in range(cfg.n_routed_experts)])

        def fc2() -> np.ndarray:  # [E, d'/64, I', 64]
            return np.stack([kernels.expert_fc2_strips(t(f"{hf}experts.{e}.down_proj.weight"))
                             for e in range(cfg.n_routed_experts)])

        x2, dtype = g.to_float(op, x2), g.plan.dtype
        strips = [g.initializer(f"{self.name}.experts.{kind}.strips", make, dtype) for kind, make in (("fc1", fc1),
                                                                                                     ("fc2", fc2))]
        routed = g.kernel_op(op, kernels.ROUTED_EXPERTS[dtype], lambda: routed_experts_function(dtype), x2, dispatch,
                             *strips)  # [N, d] float32
        return g.to_compute(op, routed)

    def _quantized_kernel(self, op, x2, dispatch) -> ir.Value:
        """All routed experts in one mla_deploy.QRoutedExperts over their codes in the kernels' layout: gate and up
        quantized as W [d, I] (the HF weights transposed), down as W [I, d], as export.quantize.DequantizedCheckpoint
        quantizes them."""
        cfg, g, t, hf, q = self.cfg, self.g, self.t, self.hf, self.g.plan.quantization
        made: dict[str, np.ndarray] = {}

        def part(key: str) -> np.ndarray:  # the four inputs, laid out once; each dropped once written
            if not made:
                quantized = {kind: [g.quantize(f"{hf}experts.{e}.{kind}_proj.weight",
                                               t(f"{hf}experts.{e}.{kind}_proj.weight").T, q.bits)
                                    for e in range(cfg.n_routed_experts)] for kind in ("gate", "up", "down")}
                made.update(layouts.routed_experts_layout(quantized["gate"], quantized["up"], quantized["down"]))
            return made.pop(key)

        weights = [g.initializer(f"{self.name}.experts.{key.replace('_', '.')}", lambda key=key: part(key),
                                 "uint8" if key.endswith("codes") else "float16")
                   for key in ("fc1_codes", "fc1_scales", "fc2_codes", "fc2_scales")]
        routed = g.kernel_op(op, kernels.QROUTED_EXPERTS[q.bits], lambda: qrouted_experts_function(q.bits),
                             g.to_float(op, x2), dispatch, *weights, block_size=q.block,
                             accuracy_level=q.accuracy_level)  # [N, d] float32
        return g.to_compute(op, routed)

    def _qmoe(self, op, x2, chosen, dispatch) -> ir.Value:
        """All routed experts in one com.microsoft QMoE: it selects by `router_probs` (the router's choice, 1.0 on
        the k chosen experts, 0.0 elsewhere) and mixes by `router_weights` (the router's weights, already scaled),
        so DeepSeek's own routing (groups, V3's selection-only bias) decides, not the op's softmax. SwiGLU with
        alpha 1 and beta 0 is silu(gate) · up; fc1 rows interleave gate and up (swiglu_fusion 1)."""
        cfg, g, q = self.cfg, self.g, self.g.plan.quantization
        made: dict[str, list] = {}

        def experts(kind: str) -> list:
            """Per expert, its fc1 or fc2 weight quantized: computed once for codes and scales."""
            if kind not in made:
                made[kind] = [self.g.quantize(f"{self.name}.experts.{e}.{kind}", self._fused_expert_weight(kind, e),
                                              q.bits) for e in range(cfg.n_routed_experts)]
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

    def _moe(self, op, x2, dispatch) -> ir.Value:
        """All routed experts in one com.microsoft MoE over float experts. Its router is softmax then top-k over
        `router_probs`: fed log(dispatch) on the chosen experts and -1e4 elsewhere, it picks DeepSeek's choice and,
        renormalised (normalize_routing_weights 1), weighs expert e by dispatch_e / sum(dispatch); the output times
        sum(dispatch) is DeepSeek's mix. fc1 [E, 2I, d] interleaves gate and up rows (swiglu_fusion 1; SwiGLU with
        alpha 1 and beta 0 is silu(gate) · up), fc2 [E, d, I]; stored in the export's dtype, multiplied in the
        compute dtype (float32 copies made at load under a float32 compute; as stored under a float16 one)."""
        cfg, g = self.cfg, self.g

        def stacked(kind: str) -> np.ndarray:  # [E, N, K]: each expert's MatMul B [K, N] transposed
            return np.stack([self._fused_expert_weight(kind, e).T for e in range(cfg.n_routed_experts)])

        fc1, fc2 = (cast(op, g.initializer(f"{self.name}.experts.{kind}", lambda kind=kind: stacked(kind),
                                           g.plan.dtype), DATA_TYPES[g.plan.dtype], g.compute_type)
                    for kind in ("fc1", "fc2"))
        # -1e4: far below any log(dispatch), and inside float16 (65504) where the logits are in it
        logits = cast(op, op.Where(op.Greater(dispatch, 0.0), op.Log(dispatch), -1e4), FLOAT, g.compute_type)
        routed = op.MoE(x2, logits, fc1, None, fc2, k=cfg.num_experts_per_tok,
                        activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                        normalize_routing_weights=1, _domain="com.microsoft")  # [N, d] in the compute dtype
        return op.Mul(routed, g.to_compute(op, op.ReduceSum(dispatch, [-1], keepdims=1)))

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
