"""export.layouts read back in graph code, for the function bodies of mla_deploy's quantized ops (export.linear:
QMatMul, QGather; export.moe: QRoutedExperts): the weight dequantized from the kernels' layout, and the activations
quantized per block as the kernels quantize them at accuracy_level 4, so that a body multiplies the values its
kernel multiplies and differs from it by float32 rounding only. Stock ONNX (Cast, Floor, Reshape, Transpose, ...),
so the bodies run on plain onnxruntime, CPU or CUDA. The weight's part depends only on initializers: onnxruntime
folds it at load into a float32 copy, which is the fallback's price.
"""

from __future__ import annotations

import onnx_ir as ir

from .builder import FLOAT
from .layouts import COLUMNS

QMAX = 127.0  # the activations' int8 codes


def nibbles(op, x: ir.Value, axis: int) -> ir.Value:
    """Bytes x (float32 holding 0..255) -> their low nibbles, then their high ones, concatenated along `axis`."""
    high = op.Floor(op.Mul(x, 1 / 16))
    return op.Concat(op.Sub(x, op.Mul(high, 16.0)), high, axis=axis)


def dequantized_weight(op, codes: ir.Value, scales: ir.Value, bits: int, lead: int = 0) -> ir.Value:
    """codes [*lead, G, KB, 2·B·bits] uint8 and float16 scales [*lead, G, KB, 16] -> W [*lead, KB·B, 16 G] float32,
    its padding rows and columns zero: (code - 2^(bits-1)) · scale, laid out back (export.layouts)."""
    keep = [0] * (lead + 2)  # Reshape's 0: the lead axes, G and KB as they are
    x = op.Cast(codes, to=FLOAT)
    high = None
    if bits == 6:  # an int4 run of the low nibbles (8 B bytes), then the high 2 bits of four quads a piece (4 B)
        third = op.Div(op.Shape(codes, start=-1), 3)  # [1]: 4 B
        high = op.Reshape(op.Slice(x, op.Mul(third, 2), op.Mul(third, 3), [-1]), keep + [-1, 1, 64])
        fields = [op.Floor(op.Mul(high, 1 / 4**i)) for i in range(5)]  # x // 4^i
        high = op.Concat(*[op.Sub(fields[i], op.Mul(fields[i + 1], 4.0)) for i in range(4)], axis=-2)  # [.., 4, 64]
        x = op.Slice(x, [0], op.Mul(third, 2), [-1])
    if bits in (4, 6):  # run byte 64 p + i: quad 2p in its low nibble, quad 2p + 1 in its high one
        x = nibbles(op, op.Reshape(x, keep + [-1, 1, 64]), axis=-2)  # [.., G, KB, B/8, 2, 64]
    if high is not None:  # quads 4h + i of piece h, bits 2i, over quads 2p + h: the same order
        x = op.Add(op.Reshape(x, keep + [-1, 64]), op.Mul(op.Reshape(high, keep + [-1, 64]), 16.0))
    q = op.Sub(op.Reshape(x, keep + [-1, COLUMNS, 4]), float(2 ** (bits - 1)))  # [.., G, KB, B/4, 16, 4]
    s = op.Reshape(op.Cast(scales, to=FLOAT), keep + [1, COLUMNS, 1])  # [.., G, KB, 1, 16, 1]
    axes = list(range(lead))
    w = op.Transpose(
        op.Mul(q, s), perm=axes + [lead + 1, lead + 2, lead + 4, lead, lead + 3]
    )  # [.., KB, B/4, 4, G, 16]
    columns = op.Mul(op.Shape(codes, start=lead, end=lead + 1), COLUMNS)  # [1]: 16 G
    return op.Reshape(w, op.Concat([0] * lead + [-1], columns, axis=0))  # [.., KB·B, 16 G]


def quantized_activations(op, x: ir.Value, k_pad: ir.Value, block: ir.Value, level: ir.Value, rank: int) -> ir.Value:
    """x [..., K] float32 (rank `rank`) zero-padded to k_pad ([1]) columns; where `level` ([1]) is 4, each block of
    `block` ([1]) values quantized to int8 as the kernels do (scale max|a| / 127, codes rint(a · (127 / max|a|)), an
    all-zero block codes as zero) and dequantized."""
    pads = op.Concat([0] * (2 * rank - 1), op.Sub(k_pad, op.Shape(x, start=-1)), axis=0)
    padded = op.Pad(x, pads)  # [..., K_pad]
    blocks = op.Reshape(padded, op.Concat([0] * (rank - 1) + [-1], block, axis=0))  # [..., KB, B]
    amax = op.ReduceMax(op.Abs(blocks), [-1], keepdims=1)  # [..., KB, 1]
    inverse = op.Where(op.Equal(amax, 0.0), 0.0, op.Div(QMAX, amax))
    codes = op.Round(op.Mul(blocks, inverse))  # half to even, as the kernels' cvtps2dq
    quantized = op.Reshape(op.Mul(codes, op.Div(amax, QMAX)), op.Shape(padded))
    return op.Where(op.Equal(level, 4), quantized, padded)
