"""The torch source's nn.Linear and nn.Embedding as graph code, in each weight form the plan chooses: float MatMul,
mla_deploy's MatMulF16 / MatMulBF16 over a half weight as stored, or MatMulNBits / GatherBlockQuantized over
block-quantized codes (export.quantize)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_ir as ir

from .. import kernels
from .builder import DATA_TYPES, FLOAT, Graph, kernel_function


def linear(g: Graph, op, x: ir.Value, name: str, make_w_in_out: Callable[[], np.ndarray], quantizable: bool = True,
           head: bool = False, island: bool = False) -> ir.Value:
    """x @ W with W stored [in, out]; through MatMulNBits when the export quantizes (the vocabulary `head` at
    head_bits). Weights that are a column subset or permutation of an HF weight's transpose are quantized like it
    (export.quantize.DequantizedCheckpoint); the fused absorbed products after absorption (DequantizedCheckpoint.
    absorbed_matrices); kv_b and the router are not `quantizable`. In a float32 `island` x is float32 and so are W
    or the quantization scales."""
    q = g.plan.quantization
    if (q is None or not quantizable) and g.plan.half_weights and not island:
        return half_matmul(g, op, x, name, make_w_in_out)
    if q is None or not quantizable:
        return op.MatMul(x, g.weight(name, make_w_in_out, island=island))
    bits = q.head_bits if head else q.bits
    codes, scales, k, n = g.quantized_weight(name, make_w_in_out, bits, island=island)
    return op.MatMulNBits(x, codes, scales, K=k, N=n, bits=bits, block_size=q.block, accuracy_level=q.accuracy_level,
                          _domain="com.microsoft")


def half_matmul(g: Graph, op, x: ir.Value, name: str, make_w_in_out: Callable[[], np.ndarray]) -> ir.Value:
    """x @ W (x float32) for a half export's weight W [K, N]: mla_deploy.MatMulF16 / MatMulBF16 over W in column
    strips (mla_deploy.kernels: it reads the stored half-precision bytes; onnxruntime's MatMul would read a float32
    copy made at load). A weight whose N is not whole strips goes through MatMul."""
    made = {}

    def w() -> np.ndarray:  # [K, N], made once for its shape and its bytes
        if "w" not in made:
            made["w"] = np.asarray(make_w_in_out())
            g.weights.shapes[name] = made["w"].shape
        return made["w"]

    if name not in g.weights.shapes:
        w()
    if g.weights.shapes[name][1] % kernels.STRIP:
        return op.MatMul(x, g.weight(name, w))
    dtype = g.plan.dtype
    strips = g.initializer(f"{name}.strips", lambda: kernels.column_strips(w()), dtype)
    return g.kernel_op(op, kernels.HALF_MATMUL[dtype], lambda: half_matmul_function(dtype), x, strips)  # [..., N]


def strip_matmul(op, a: ir.Value, strips: ir.Value) -> ir.Value:
    """A [..., K] float32 @ W, W [K, N] given as its half-precision column strips [N/64, K, 64]."""
    w = op.Reshape(op.Transpose(strips, perm=[1, 0, 2]), [0, -1])  # [N/64, K, 64] -> [K, N/64, 64] -> [K, N]
    return op.MatMul(a, op.Cast(w, to=FLOAT))  # [..., K] @ [K, N] -> [..., N] float32


def half_matmul_function(dtype: str) -> ir.Function:
    """The body of mla_deploy's MatMul by a `dtype` (float16, bfloat16) weight: what onnxruntime runs where the kernel
    library is not registered (it folds the weight's re-layout and cast at load into a float32 copy)."""
    return kernel_function(kernels.HALF_MATMUL[dtype], {"A": FLOAT, "B": DATA_TYPES[dtype]}, "Y", strip_matmul,
                           f"Y = A @ W for float32 A and a {dtype} W stored as column strips B [N/64, K, 64]; "
                           "mla-deploy's kernel library (mla_deploy.kernels) runs it reading W as stored, this body "
                           "where that is not registered.")


def embedding(g: Graph, ids: ir.Value, make_vocab_by_d: Callable[[], np.ndarray]) -> ir.Value:
    """ids [b, T] -> rows [b, T, d] of the embedding; quantized, GatherBlockQuantized over the codes a tied head's
    MatMulNBits reads too (the quantized weight `embed` is Eᵀ [d, V]: one code row per token, blocks along d)."""
    q = g.plan.quantization
    if q is None:  # rows gathered in the stored dtype, then cast: a bfloat16 table is never widened whole
        rows = g.op.Gather(g.initializer("embed", make_vocab_by_d, g.plan.dtype), ids, axis=0)  # [b, T, d]
        return rows if g.stored_type == g.compute_type else g.op.Cast(rows, to=g.compute_type)
    bits = q.head_bits
    _, scales, d, vocab = g.quantized_weight("embed", lambda: make_vocab_by_d().T, bits)
    rows = g.weight_view("embed.rows", "embed.codes", (vocab, (d + -d % q.block) * bits // 8))  # [V, k_blocks·blob]
    return g.op.GatherBlockQuantized(rows, ids, scales, gather_axis=0, quantize_axis=1, block_size=q.block,
                                     bits=bits, _domain="com.microsoft")  # [b, T, d]
