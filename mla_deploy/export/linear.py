"""The torch source's nn.Linear and nn.Embedding as graph code, in each weight form the plan chooses: float MatMul,
mla_deploy's MatMulF16 / MatMulBF16 over a half weight as stored, and over block-quantized codes (export.quantize)
mla_deploy's QMatMul / QGather (the kernels' layout, export.layouts) or onnxruntime's MatMulNBits /
GatherBlockQuantized; and the function bodies of mla_deploy's ops, which onnxruntime runs where the kernel library
is not registered."""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_ir as ir

from .. import kernels
from .builder import DATA_TYPES, FLOAT, Graph, attribute, kernel_function
from .dequantize import dequantized_weight, quantized_activations
from .layouts import COLUMNS

UINT8, FLOAT16 = ir.DataType.UINT8, ir.DataType.FLOAT16


def linear(g: Graph, op, x: ir.Value, name: str, make_w_in_out: Callable[[], np.ndarray], quantizable: bool = True,
           head: bool = False, island: bool = False) -> ir.Value:
    """x @ W with W stored [in, out]; quantized when the export quantizes (the vocabulary `head` at head_bits), in
    the plan's quantized ops. Weights that are a column subset or permutation of an HF weight's transpose are
    quantized like it (export.quantize.DequantizedCheckpoint); the fused absorbed products after absorption
    (DequantizedCheckpoint.absorbed_matrices); kv_b and the router are not `quantizable`. In a float32 `island` x is
    float32 and so are W or MatMulNBits' scales."""
    q = g.plan.quantization
    if (q is None or not quantizable) and g.plan.half_kernels and not island:
        return half_matmul(g, op, x, name, make_w_in_out)
    if q is None or not quantizable:
        return op.MatMul(x, g.weight(name, make_w_in_out, island=island))
    bits = q.head_bits if head else q.bits
    codes, scales, k, n = g.quantized_weight(name, make_w_in_out, bits, island=island)
    if g.plan.quantized_ops == "onnxruntime":
        return op.MatMulNBits(x, codes, scales, K=k, N=n, bits=bits, block_size=q.block,
                              accuracy_level=q.accuracy_level, _domain="com.microsoft")
    y = g.kernel_op(op, kernels.QMATMUL[bits], lambda: qmatmul_function(bits), x if island else g.to_float(op, x),
                    codes, scales, K=k, N=n, block_size=q.block, accuracy_level=q.accuracy_level)  # [..., N] float32
    return y if island else g.to_compute(op, y)


def per_head_quantized(plan) -> bool:
    """The factored form's per-head W^UK / W^UV are block-quantized (QBatchMatMul) rather than float32."""
    q = plan.quantization
    return q is not None and q.per_head_bits is not None


def head_linear(g: Graph, op, x: ir.Value, name: str, make_heads: Callable[[], np.ndarray]) -> ir.Value:
    """x [M, h, K] float32 -> [M, h, N], row m's head h times W_h, W [h, K, N] (the factored form's W^UK, W^UVᵀ):
    mla_deploy.QBatchMatMul over each head's codes at the plan's per_head_bits, or a float32 batched MatMul. The
    quantized values are export.quantize.per_head_rounded_kv_b's, which the source the graphs are written from
    already holds."""
    if not per_head_quantized(g.plan):
        heads_first = op.Transpose(x, perm=[1, 0, 2])  # [h, M, K]
        return op.Transpose(op.MatMul(heads_first, g.weight(name, make_heads, island=True)), perm=[1, 0, 2])
    q = g.plan.quantization
    bits = q.per_head_bits
    codes, scales, k, n = g.quantized_weight(name, make_heads, bits, island=True, heads=True)
    return g.kernel_op(op, kernels.QBATCH_MATMUL[bits], lambda: qbatch_matmul_function(bits), x, codes, scales,
                       K=k, N=n, block_size=q.block, accuracy_level=q.accuracy_level)  # [M, h, N] float32


def qmatmul(op, a: ir.Value, codes: ir.Value, scales: ir.Value, bits: int) -> ir.Value:
    """A [..., K] float32 @ W for an int`bits` W [K, N] in the kernels' layout (codes [G, KB, 2·B·bits], float16
    scales [G, KB, 16]); K, N, block_size and accuracy_level are the calling node's attributes: at 4, A's rows are
    quantized per block first, as the kernel quantizes them."""
    k, n, block = attribute(op, "K"), attribute(op, "N"), attribute(op, "block_size")
    rows = op.Reshape(a, op.Concat([-1], k, axis=0))  # [M, K]
    k_pad = op.Mul(op.Shape(codes, start=1, end=2), block)  # [1]: KB·B
    rows = quantized_activations(op, rows, k_pad, block, attribute(op, "accuracy_level"), rank=2)  # [M, K_pad]
    w = op.Slice(dequantized_weight(op, codes, scales, bits), [0], n, [1])  # [K_pad, 16 G] -> [K_pad, N]
    return op.Reshape(op.MatMul(rows, w), op.Concat(op.Shape(a, end=-1), n, axis=0))  # [M, N] -> [..., N]


def qmatmul_function(bits: int) -> ir.Function:
    """The body of mla_deploy.QMatMul4 / QMatMul8: what onnxruntime runs where the kernel library is not registered
    (it folds the weight's dequantization at load into a float32 copy)."""
    return kernel_function(
        kernels.QMATMUL[bits],
        {"A": FLOAT, "codes": UINT8, "scales": FLOAT16},
        "Y",
        lambda op, a, codes, scales: qmatmul(op, a, codes, scales, bits),
        f"Y = A @ W for float32 A [..., K] and an int{bits} W [K, N] in mla-deploy's quantized layout "
        "(export.layouts: codes [G, KB, 2·B·bits], float16 scales [G, KB, 16]); accuracy_level 4 "
        "quantizes A's rows per block to int8 first. mla-deploy's kernel library reads W as stored; "
        "this body, where that is not registered, multiplies by a float32 copy folded at load.",
        attributes={"K": None, "N": None, "block_size": None, "accuracy_level": 0},
    )


def qbatch_matmul(op, a: ir.Value, codes: ir.Value, scales: ir.Value, bits: int) -> ir.Value:
    """A [M, H, K] float32, row m's head h @ W_h, each an int`bits` W_h [K, N] in the kernels' layout, stacked: codes
    [H, G, KB, 2·B·bits], float16 scales [H, G, KB, 16] -> [M, H, N]; attributes as qmatmul's."""
    n, block = attribute(op, "N"), attribute(op, "block_size")
    k_pad = op.Mul(op.Shape(codes, start=2, end=3), block)  # [1]: KB·B
    rows = quantized_activations(op, op.Transpose(a, perm=[1, 0, 2]), k_pad, block, attribute(op, "accuracy_level"),
                                 rank=3)  # [H, M, K_pad]
    w = op.Slice(dequantized_weight(op, codes, scales, bits, lead=1), [0], n, [2])  # [H, K_pad, 16 G] -> [H, K_pad, N]
    return op.Transpose(op.MatMul(rows, w), perm=[1, 0, 2])  # [H, M, N] -> [M, H, N]


def qbatch_matmul_function(bits: int) -> ir.Function:
    """The body of mla_deploy.QBatchMatMul4 / QBatchMatMul8."""
    return kernel_function(
        kernels.QBATCH_MATMUL[bits],
        {"A": FLOAT, "codes": UINT8, "scales": FLOAT16},
        "Y",
        lambda op, a, codes, scales: qbatch_matmul(op, a, codes, scales, bits),
        f"Y[m, h] = A[m, h] @ W_h for float32 A [M, H, K] and one int{bits} W_h [K, N] per h in mla-deploy's quantized "
        "layout, stacked (codes [H, G, KB, 2·B·bits], float16 scales [H, G, KB, 16]); accuracy_level 4 quantizes "
        "A's rows per block to int8 first. The kernel library reads the weights as stored; this body multiplies by "
        "a float32 copy folded at load.",
        attributes={"K": None, "N": None, "block_size": None, "accuracy_level": 0},
    )


def qgather(op, ids: ir.Value, codes: ir.Value, scales: ir.Value, bits: int) -> ir.Value:
    """ids [...] -> columns ids of an int`bits` W [K, N] in the kernels' layout, dequantized: [..., K] float32 (a
    tied head's Eᵀ read as embedding rows). K and N are the calling node's attributes; negative ids count from the
    end, as Gather's. Each id's 16-column group is dequantized at run time, so nothing is folded at load."""
    k, n = attribute(op, "K"), attribute(op, "N")
    flat = op.Reshape(ids, [-1])  # [T]
    token = op.Where(op.Less(flat, 0), op.Add(flat, n), flat)
    group = op.Div(token, COLUMNS)
    runs = op.Unsqueeze(op.Gather(codes, group, axis=0), [1])  # [T, 1, KB, 2·B·bits]: one group per token
    run_scales = op.Unsqueeze(op.Gather(scales, group, axis=0), [1])  # [T, 1, KB, 16]
    columns = op.Transpose(dequantized_weight(op, runs, run_scales, bits, lead=1), perm=[0, 2, 1])  # [T, 16, KB·B]
    lane = op.Unsqueeze(op.Mod(token, COLUMNS), [1])  # [T, 1]
    rows = op.Slice(op.GatherND(columns, lane, batch_dims=1), [0], k, [1])  # [T, KB·B] -> [T, K]
    return op.Reshape(rows, op.Concat(op.Shape(ids), k, axis=0))  # [..., K]


def qgather_function(bits: int) -> ir.Function:
    """The body of mla_deploy.QGather4 / QGather8."""
    return kernel_function(kernels.QGATHER[bits], {"ids": ir.DataType.INT64, "codes": UINT8, "scales": FLOAT16}, "out",
                           lambda op, ids, codes, scales: qgather(op, ids, codes, scales, bits),
                           f"out[..., :] = W[:, ids[...]] dequantized, for an int{bits} W [K, N] in mla-deploy's "
                           "quantized layout (export.layouts): a tied head's embedding rows, or a separate embedding "
                           "table stored as its transpose.",
                           attributes={"K": None, "N": None, "block_size": None})


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
    """ids [b, T] -> rows [b, T, d] of the embedding. Quantized, the weight `embed` is Eᵀ [d, V] (blocks along d),
    whose codes a tied head multiplies by too: read by mla_deploy.QGather, or by GatherBlockQuantized over its
    MatMulNBits codes as rows [V, KB·blob] (their d padded to whole blocks: sliced back to d)."""
    q, op = g.plan.quantization, g.op
    if q is None:  # rows gathered in the stored dtype, then cast: a bfloat16 table is never widened whole
        rows = op.Gather(g.initializer("embed", make_vocab_by_d, g.plan.dtype), ids, axis=0)  # [b, T, d]
        return rows if g.stored_type == g.compute_type else op.Cast(rows, to=g.compute_type)
    bits = q.head_bits
    codes, scales, d, vocab = g.quantized_weight("embed", lambda: make_vocab_by_d().T, bits)
    if g.plan.quantized_ops == "kernel":
        rows = g.kernel_op(op, kernels.QGATHER[bits], lambda: qgather_function(bits), ids, codes, scales, K=d, N=vocab,
                           block_size=q.block)  # [b, T, d] float32
        return g.to_compute(op, rows)
    table = g.weight_view("embed.rows", "embed.codes", (vocab, (d + -d % q.block) * bits // 8))  # [V, k_blocks·blob]
    rows = op.GatherBlockQuantized(table, ids, scales, gather_axis=0, quantize_axis=1, block_size=q.block, bits=bits,
                                   _domain="com.microsoft")  # [b, T, d padded to whole blocks]
    return rows if d % q.block == 0 else op.Slice(rows, [0], [d], [2])
