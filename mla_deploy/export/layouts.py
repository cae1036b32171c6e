"""The weight layouts of mla-deploy's quantized kernels (mla_deploy.kernels: QMatMul, QRoutedExperts, QGather):
pure functions over numpy arrays, from export.quantize's codes to the bytes the kernels read where they lie in the
mapped weights.bin, and back.

A quantized weight W [K, N] (blocks of B values along K per output column, one float16 scale per block, codes
unsigned with zero point z = 2^(bits-1): export.quantize) is cut into groups of 16 output columns, N padded up to a
whole group (the padding columns: code z, scale 0). Per group g and block j the kernels read one contiguous run:

    codes  uint8   [G, KB, 2·B·bits]     G = ceil(N / 16), KB = ceil(K / B)
    scales float16 [G, KB, 16]           scales[g, j, c] = s[16 g + c, j]

int8: run byte 64 q + 4 c + t is the code of column 16 g + c at k = j B + 4 q + t (q < B / 4, t < 4): each 64
bytes hold four consecutive k of 16 columns, one 32-bit lane per column, the operand of one vpdpbusd (or of two
vpmaddubsw on 32-byte halves) against four activation bytes broadcast to every lane.
int4: run byte 64 p + 4 c + t holds, in its low nibble, the code of column 16 g + c at k = j B + 8 p + t, and in its
high nibble the one at k = j B + 8 p + 4 + t (p < B / 8): a mask and a shift turn 64 bytes into the two 64-byte
quads 2p and 2p + 1 of the int8 run.
int6 (a head at 6 bits): the run's first 8 B bytes are the int4 run of the codes' low nibbles; byte 8 B + 64 h +
4 c + t holds in bits 2 i and 2 i + 1 the high 2 bits of the code at k = j B + 4 (4 h + i) + t (h < B / 16).

Every kernel input is such a pair (or a stack of them, one per expert), so a function body (export.
dequantize) dequantizes it with stock ONNX: Cast the bytes; for int4 split the nibbles as floor(x / 16)
and x - 16 floor(x / 16) and interleave them as quads; Reshape to [G, KB, B/4, 16, 4], subtract z, multiply by the
scales [G, KB, 1, 16, 1], Transpose to [KB, B/4, 4, G, 16] and Reshape to [KB·B, 16 G], then Slice [K, N].
"""

from __future__ import annotations

import numpy as np

from .quantize import QuantizedWeight, dequantize, unpack_codes

COLUMNS = 16  # output columns per group: one 512-bit register of int32 sums
SCALE_DTYPE = np.float16
NAME = "mla_deploy.q16"  # the layout's name in a manifest


RUNS = {
    8: "int8: byte 64q+4c+t = code of column 16g+c at k = j*block+4q+t",
    4: "int4: byte 64p+4c+t = code at k = j*block+8p+t (low nibble) | code at k+4 (high nibble)",
    6: "int6: bytes 0 .. 8*block-1 the int4 run of the codes' low nibbles; byte 8*block+64h+4c+t bits 2i, 2i+1 = "
       "high 2 bits of the code at k = j*block+4(4h+i)+t",
}


def groups(n: int) -> int:
    return -(-n // COLUMNS)


def describe(bits: int, block: int) -> dict:
    """What a manifest records of a weight stored in this layout: enough to read it back without this module."""
    zero = 2 ** (bits - 1)
    return {"layout": NAME, "bits": bits, "block": block, "columns_per_group": COLUMNS, "scale_dtype": "float16",
            "zero_point": zero, "codes": "uint8 [ceil(N/16), ceil(K/block), 2*block*bits]",
            "scales": "float16 [ceil(N/16), ceil(K/block), 16]",
            "run": RUNS[bits],
            "value": f"(code - {zero}) * scale; padding columns and the last block's padding dequantize to 0"}


def qmatmul_layout(qw: QuantizedWeight) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' codes [G, KB, 2·B·bits] (uint8) and scales [G, KB, 16] (float16) of a quantized W [K, N]. Its
    scales must be float16 values (export.quantize.quantize(..., scale_dtype="float16")): the codes were computed
    against them, so the layout holds exactly the weight export.quantize.dequantize gives."""
    scales = np.asarray(qw.scales)
    half = scales.astype(SCALE_DTYPE)
    if not np.array_equal(half.astype(np.float32), scales.astype(np.float32)):
        raise ValueError("qmatmul_layout: the scales are not float16 values; quantize with scale_dtype='float16' "
                         "so that the codes are computed against the scales the kernels read")
    n, kb, g = qw.n, qw.codes.shape[1], groups(qw.n)
    signed = unpack_codes(qw)  # [N, KB, B] int16
    zero = 2 ** (qw.bits - 1)
    codes = np.full((g * COLUMNS, kb, qw.block), zero, np.int16)
    codes[:n] = signed + zero
    codes = codes.reshape(g, COLUMNS, kb, qw.block // 4, 4).transpose(0, 2, 3, 1, 4)  # [G, KB, B/4, 16, 4]
    high = None
    if qw.bits == 6:  # the high 2 bits of quads 4h .. 4h + 3 in one piece, quad 4h + i at bits 2i
        high = (codes >> 4).reshape(g, kb, qw.block // 16, 4, COLUMNS, 4)
        high = sum(high[:, :, :, i] << (2 * i) for i in range(4)).reshape(g, kb, -1)  # [G, KB, B/16 · 64]
        codes = codes & 0xF
    if qw.bits in (4, 6):
        quads = codes.reshape(g, kb, qw.block // 8, 2, COLUMNS, 4)  # quad 2p + h
        codes = quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)  # [G, KB, B/8, 16, 4]
    codes = codes.reshape(g, kb, -1)
    if high is not None:
        codes = np.concatenate([codes, high], axis=-1)  # [G, KB, 8 B + 4 B]
    out_scales = np.zeros((g * COLUMNS, kb), SCALE_DTYPE)
    out_scales[:n] = half
    return (np.ascontiguousarray(codes.astype(np.uint8)),
            np.ascontiguousarray(out_scales.reshape(g, COLUMNS, kb).transpose(0, 2, 1)))


def qmatmul_unlayout(codes: np.ndarray, scales: np.ndarray, k: int, n: int, bits: int, block: int) -> QuantizedWeight:
    """The inverse of qmatmul_layout: export.quantize's QuantizedWeight (MatMulNBits packing, float16 scales) of W
    [k, n] from the kernels' codes and scales."""
    g, kb = codes.shape[:2]
    if codes.shape != (g, kb, 2 * block * bits) or scales.shape != (g, kb, COLUMNS) or g != groups(n) or \
            kb != -(-k // block):
        raise ValueError(f"qmatmul_unlayout: codes {codes.shape} and scales {scales.shape} do not hold a {bits}-bit "
                         f"[{k}, {n}] weight in blocks of {block}")
    run = codes.astype(np.int16)
    high = None
    if bits == 6:
        run, high = run[..., : 8 * block], run[..., 8 * block :].reshape(g, kb, block // 16, 1, COLUMNS, 4)
        high = np.concatenate([(high >> (2 * i)) & 3 for i in range(4)], axis=3)  # [G, KB, B/16, 4, 16, 4]
    if bits in (4, 6):
        run = run.reshape(g, kb, block // 8, 1, COLUMNS, 4)
        run = np.concatenate([run & 0xF, run >> 4], axis=3)  # [G, KB, B/8, 2, 16, 4]: quads 2p, 2p + 1
    if high is not None:
        run = run.reshape(high.shape) | (high << 4)
    run = run.reshape(g, kb, block // 4, COLUMNS, 4).transpose(0, 3, 1, 2, 4)  # [G, 16, KB, B/4, 4]
    unsigned = run.reshape(g * COLUMNS, kb, block)[:n]
    if bits == 4:
        unsigned = unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)
    per_column = np.ascontiguousarray(scales.transpose(0, 2, 1).reshape(g * COLUMNS, kb)[:n])
    return QuantizedWeight(np.ascontiguousarray(unsigned.astype(np.uint8)), per_column, bits, block, k)


def gate_up_columns(gate: QuantizedWeight, up: QuantizedWeight) -> QuantizedWeight:
    """An expert's gate and up (each W [d, I], quantized) as one weight [d, 2 I'] whose 16-column groups alternate
    gate and up: group 2 i holds gate's columns 16 i .. 16 i + 15 and group 2 i + 1 up's same columns, so one pair
    of groups gives 16 finished activations silu(gate) · up. I' = I rounded up to 16; the padding columns are zero."""
    if (gate.k, gate.n, gate.bits, gate.block) != (up.k, up.n, up.bits, up.block):
        raise ValueError("gate_up_columns: gate and up must have the same shape, bits and block")
    padded = groups(gate.n) * COLUMNS
    zero = (2 ** (gate.bits - 1)) * (0x11 if gate.bits == 4 else 1)  # a byte of zero-point codes
    codes = np.full((2, padded) + gate.codes.shape[1:], zero, np.uint8)
    scales = np.zeros((2, padded, gate.scales.shape[1]), gate.scales.dtype)
    for i, w in enumerate((gate, up)):
        codes[i, : w.n], scales[i, : w.n] = w.codes, w.scales

    def interleave(x):  # [2, I'/16 · 16, ...] -> [I'/16, 2, 16, ...] -> [2 I', ...]
        return np.ascontiguousarray(x.reshape((2, padded // COLUMNS, COLUMNS) + x.shape[2:]).swapaxes(0, 1)
                                    .reshape((2 * padded,) + x.shape[2:]))
    return QuantizedWeight(interleave(codes), interleave(scales), gate.bits, gate.block, gate.k)


def routed_experts_layout(gates: list[QuantizedWeight], ups: list[QuantizedWeight],
                          downs: list[QuantizedWeight]) -> dict[str, np.ndarray]:
    """QRoutedExperts' four weight inputs from every expert's quantized gate and up (W [d, I]) and down (W [I, d]):
    fc1_codes [E, 2 I'/16, ceil(d/B), 2·B·bits], fc1_scales [E, 2 I'/16, ceil(d/B), 16] (gate_up_columns),
    fc2_codes [E, ceil(d/16), ceil(I/B), 2·B·bits], fc2_scales [E, ceil(d/16), ceil(I/B), 16]."""
    fc1 = [qmatmul_layout(gate_up_columns(g, u)) for g, u in zip(gates, ups)]
    fc2 = [qmatmul_layout(d) for d in downs]
    return {"fc1_codes": np.stack([c for c, _ in fc1]), "fc1_scales": np.stack([s for _, s in fc1]),
            "fc2_codes": np.stack([c for c, _ in fc2]), "fc2_scales": np.stack([s for _, s in fc2])}


def dequantize_layout(codes: np.ndarray, scales: np.ndarray, k: int, n: int, bits: int, block: int) -> np.ndarray:
    """W [k, n] float32 as the kernels' layout holds it: what QMatMul at accuracy level 0 multiplies by."""
    return dequantize(qmatmul_unlayout(codes, scales, k, n, bits, block))
