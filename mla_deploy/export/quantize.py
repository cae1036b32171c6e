"""Block-wise symmetric weight quantization in onnxruntime's MatMulNBits layout: pure functions over tensors.

A MatMul weight W [K, N] (stored [in, out], as every graph weight) is cut along K into blocks of `block`
values per output column n. Block j of column n gets one scale

    s[n, j] = max |W[jB : (j+1)B, n]| / qmax,      qmax = 2^(bits-1) - 1   (7 for int4, 127 for int8)

and codes q = round(W / s) in [-qmax, qmax] (ties to even), stored unsigned as q + 2^(bits-1), MatMulNBits'
default zero point, so no zero-point tensor is needed. Codes are packed along K low bits first: two int4
codes per byte; int6 codes (the head only, as llama.cpp's q6_K: mla-deploy's kernels read it, MatMulNBits does
not) one per byte here, packed by export.layouts. A K that is not a multiple of the block is zero-padded (padding
codes dequantize to 0).
Dequantized: W'[k, n] = (code - 2^(bits-1)) · s[n, k // B]; every |W - W'| <= s / 2.

Scales are float32, or float16 (as llama.cpp's q4_0 / q8_0 store them: 0.5625 / 1.0625 bytes per weight at block 32
instead of 0.625 / 1.125, which a batch-1 decode reads at the memory bandwidth). With float16 scales each scale is
rounded to float16 first and the codes are computed against the rounded scale, so the dequantized weight is exactly
what a kernel reading float16 scales multiplies by; a code can then reach qmax and be clipped (the rounded scale may
be a little smaller than max |W| / qmax), which adds at most qmax · 2^-11 · s to that element's error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..checkpoint import Checkpoint, CheckpointView, expected_tensors, mtp_tensors
from ..config import MLAConfig
from . import absorb

BITS = (4, 8)  # an export's weights, and the per-head matrices
HEAD_BITS = (4, 6, 8)  # the embedding and the output layer
BLOCKS = (16, 32, 64, 128)
SCALE_DTYPES = ("float32", "float16")
ACCURACY_LEVELS = (0, 4)  # 0: float activations (exact against the dequantized weights); 4: int8 activations
# HF linear weights left in float: kv_b (prefill decompresses with it, decode splits it into the small per-head W^UK /
# W^UV, so one float copy keeps both graphs on the same weights), the routers (tiny, and they choose the experts).
FLOAT_LINEARS = ("self_attn.kv_b_proj.weight", "mlp.gate.weight")
KV_B = FLOAT_LINEARS[0]
HEAD_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")  # quantized at Quantization.head_bits


@dataclass(frozen=True)
class Quantization:
    """What `export --quantize` asked for: every quantizable MatMul weight as block-quantized codes (laid out for
    mla_deploy's quantized kernels, export.layouts, or for onnxruntime's MatMulNBits: export.plan)."""

    bits: int
    block: int = 32
    accuracy_level: int = 4
    # The embedding and the head: 4, 6 or 8 bits whatever `bits` is (the plan picks: export.plan, head bits).
    head_bits: int = 8
    scale_dtype: str = "float32"  # float16: what mla_deploy's quantized kernels read (export/layouts.py)
    # The factored form's per-head W^UK [d_nope, d_c] and W^UV^T [d_c, d_v] (kv_b_proj split by head), multiplied by
    # mla_deploy.QBatchMatMul: 4 or 8 bits, or None to keep them float32. 27 x 8.4 MB of float32 a token reads in
    # the full DeepSeek-V2-Lite, 2.2 MB a layer at 8 bits, 1.2 MB at 4 (per_head_rounded_kv_b).
    per_head_bits: int | None = None

    def __post_init__(self):
        if self.head_bits not in HEAD_BITS:
            raise ValueError(f"head_bits={self.head_bits}: expected one of {HEAD_BITS}")
        if self.per_head_bits not in (None, *BITS):
            raise ValueError(f"per_head_bits={self.per_head_bits}: expected None or one of {BITS}")
        if self.bits not in BITS:
            raise ValueError(f"bits={self.bits}: expected one of {BITS}")
        _check(self.bits, self.block, self.scale_dtype)
        if self.accuracy_level not in ACCURACY_LEVELS:
            raise ValueError(f"accuracy_level={self.accuracy_level}: expected one of {ACCURACY_LEVELS}")

    def to_dict(self) -> dict:
        return {
            "method": "block-wise symmetric: one scale per block of `block` values along K per output column, codes "
            "unsigned with zero point 2^(bits-1)",
            **asdict(self),
        }

    @classmethod
    def from_dict(cls, recorded: dict) -> "Quantization":
        """The spec an export's manifest records (`to_dict` plus what the exporter adds)."""
        return cls(recorded["bits"], recorded["block"], recorded["accuracy_level"], recorded["head_bits"],
                   recorded.get("scale_dtype", "float32"), recorded.get("per_head_bits"))

    def bytes_per_weight(self, bits: int | None = None) -> float:
        """Codes plus one scale per block."""
        return (bits or self.bits) / 8 + np.dtype(self.scale_dtype).itemsize / self.block

    def bits_of(self, hf_name: str) -> int:
        return self.head_bits if hf_name in HEAD_WEIGHTS else self.bits


def quantized_hf_names(cfg: MLAConfig, mtp: bool = False) -> list[str]:
    """The HF weights a quantized export stores as codes: every matrix but FLOAT_LINEARS (with `mtp`, the MTP layer's
    too, eh_proj included). The embedding is read by GatherBlockQuantized (and, tied, by the head's MatMulNBits: the
    same codes, stored once)."""
    tensors = {**expected_tensors(cfg), **(mtp_tensors(cfg) if mtp else {})}
    return [name for name, shape in tensors.items() if len(shape) == 2 and not name.endswith(FLOAT_LINEARS)]


class DequantizedCheckpoint(CheckpointView):
    """A checkpoint whose quantized weights read as their dequantized values: the source a quantized export is
    compared with exactly. Every graph weight made from an HF weight W [out, in] is a column subset or
    permutation of Wᵀ, and the blocks run along `in` per column, so quantizing W row by row is the same. A `fused`
    export quantizes the absorbed products W^Q·W^UK and W^UV·W^O themselves: `absorbed_matrices` gives them
    dequantized, for the source's absorbed attention to use in their place."""

    def __init__(self, ckpt: Checkpoint, quantization: Quantization, fused: bool = False):
        super().__init__(ckpt)
        self.quantization, self.fused = quantization, fused
        self._quantized = set(quantized_hf_names(ckpt.config, mtp=True))

    def tensor(self, name: str) -> np.ndarray:
        w = self.ckpt.tensor(name)
        q = self.quantization
        if name.endswith(KV_B) and q.per_head_bits and not self.fused:
            return per_head_rounded_kv_b(self.config, w, q)
        if name not in self._quantized:
            return w
        return np.ascontiguousarray(dequantize(quantize(w.T, q.bits_of(name), q.block, scale_dtype=q.scale_dtype)).T)

    def absorbed_matrices(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Layer `layer`'s fused W^Q·W^UK [in, h·d_c] and W^UV·W^O [h·d_c, d] as the export quantized them (from the
        float factors, after absorption), dequantized; None unless the export is fused."""
        if not self.fused:
            return None
        cfg, q, hf = self.config, self.quantization, f"model.layers.{layer}.self_attn."
        q_weight = self.ckpt.tensor(hf + ("q_proj.weight" if cfg.q_lora_rank is None else "q_b_proj.weight"))
        kv_b, o_weight = self.ckpt.tensor(hf + "kv_b_proj.weight"), self.ckpt.tensor(hf + "o_proj.weight")
        return tuple(dequantize(quantize(w, q.bits, q.block, scale_dtype=q.scale_dtype)) for w in (
            absorb.fused_query_absorb(cfg, q_weight, kv_b), absorb.fused_output_absorb(cfg, o_weight, kv_b)))


def per_head_rounded_kv_b(cfg: MLAConfig, kv_b: np.ndarray, q: Quantization) -> np.ndarray:
    """kv_b_proj.weight [h·(d_nope+d_v), d_c] as a factored export with per-head quantization stands for it: each
    head's W^UK [d_nope, d_c] quantized as a weight [K = d_nope, N = d_c] and W^UV^T [d_c, d_v] as [K = d_c, N = d_v]
    (the blocks along what each product sums over), at `q.per_head_bits`, dequantized back into place. The prefill
    graph's float kv_b holds these values too, so both graphs compute with the same weights; quantizing them again
    gives the same codes (a block's largest value stays its scale's multiple)."""
    bits = q.per_head_bits

    def rounded(w: np.ndarray) -> np.ndarray:  # [K, N]
        return dequantize(quantize(w, bits, q.block, scale_dtype=q.scale_dtype))

    w_uk, w_uv = absorb.split_kv_b(cfg, kv_b)  # [h, d_nope, d_c], [h, d_v, d_c]
    heads = [np.concatenate([rounded(uk), rounded(uv.T).T]) for uk, uv in zip(w_uk, w_uv)]  # [d_nope + d_v, d_c]
    return np.concatenate(heads).astype(kv_b.dtype)  # [h·(d_nope+d_v), d_c]


class PerHeadRounded(CheckpointView):
    """A checkpoint whose kv_b_proj weights read as per_head_rounded_kv_b: what a factored export quantizing its
    per-head W^UK / W^UV writes from (the other weights as they are: the exporter quantizes them itself)."""

    def __init__(self, ckpt, quantization: Quantization):
        super().__init__(ckpt)
        self.quantization = quantization

    def tensor(self, name: str) -> np.ndarray:
        w = self.ckpt.tensor(name)
        return per_head_rounded_kv_b(self.config, w, self.quantization) if name.endswith(KV_B) else w


@dataclass(frozen=True)
class QuantizedWeight:
    codes: np.ndarray  # uint8 [N, k_blocks, code_bytes(bits, block)]: MatMulNBits' B (int6: one code a byte)
    scales: np.ndarray  # float32 or float16 [N, k_blocks]
    bits: int
    block: int
    k: int  # rows of the float weight before padding to whole blocks

    @property
    def n(self) -> int:
        return self.codes.shape[0]


def code_bytes(bits: int, block: int) -> int:
    """Bytes of one block's codes in a QuantizedWeight: packed for int4 and int8, one a byte for int6."""
    return block * bits // 8 if bits != 6 else block


def quantize(w: np.ndarray, bits: int, block: int, chunk_bytes: int = 1 << 26,
             scale_dtype: str = "float32") -> QuantizedWeight:
    """W [K, N] (float) -> codes and scales; the arithmetic in float64, scales stored as `scale_dtype`. Columns are
    quantized a chunk at a time (`chunk_bytes` of float64 work), so a vocabulary-sized head costs its codes, not
    several float64 copies of itself."""
    _check(bits, block, scale_dtype)
    k, n = w.shape
    k_blocks = -(-k // block)
    codes = np.empty((n, k_blocks, code_bytes(bits, block)), np.uint8)
    scales = np.empty((n, k_blocks), scale_dtype)
    step = max(1, chunk_bytes // (8 * k_blocks * block))
    for start in range(0, n, step):
        cols = slice(start, min(start + step, n))
        codes[cols], scales[cols] = _quantize_columns(w[:, cols], bits, block, k_blocks, np.dtype(scale_dtype))
    return QuantizedWeight(codes, scales, bits, block, k)


def _check(bits: int, block: int, scale_dtype: str = "float32") -> None:
    if bits not in HEAD_BITS:
        raise ValueError(f"bits={bits}: expected one of {HEAD_BITS}")
    if block not in BLOCKS:
        raise ValueError(f"block={block}: expected one of {BLOCKS}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale_dtype!r}: expected one of {SCALE_DTYPES}")


def _quantize_columns(w: np.ndarray, bits: int, block: int, k_blocks: int,
                      scale_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    k, n = w.shape
    padded = np.zeros((k_blocks * block, n), np.float64)
    padded[:k] = w
    blocks = padded.T.reshape(n, k_blocks, block)  # [K_pad, n] -> [n, k_blocks, B]
    qmax = 2 ** (bits - 1) - 1
    exact = np.abs(blocks).max(axis=-1) / qmax  # [n, k_blocks]
    with np.errstate(over="ignore"):
        scales = exact.astype(scale_dtype)
    if not np.isfinite(scales).all():
        worst = float(exact[~np.isfinite(scales)].max())
        raise ValueError(f"quantize: a block's scale max|W| / {qmax} = {worst:.4g} does not fit in {scale_dtype} "
                         "(largest 65504): quantize with scale_dtype='float32'")
    safe = np.where(scales == 0, 1.0, scales.astype(np.float64))[..., None]  # an all-zero block codes as zero
    q = np.clip(np.rint(blocks / safe), -qmax, qmax).astype(np.int16)  # [n, k_blocks, B]
    unsigned = (q + 2 ** (bits - 1)).astype(np.uint8)
    if bits == 4:
        unsigned = unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)  # [n, k_blocks, B/2]: low nibble first
    return unsigned, scales


def unpack_codes(qw: QuantizedWeight) -> np.ndarray:
    """Signed codes [N, k_blocks, B] (int16) from the packed bytes."""
    codes = qw.codes.astype(np.int16)
    if qw.bits == 4:
        codes = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(
            qw.n, -1, qw.block
        )  # [N, k_blocks, B/2, 2] -> [N, k_blocks, B]
    return codes - 2 ** (qw.bits - 1)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """The float32 weight [K, N] the quantized one stands for: what an exact export is checked against."""
    values = unpack_codes(qw) * qw.scales.astype(np.float32)[..., None]  # [N, k_blocks, B]
    return np.ascontiguousarray(values.reshape(qw.n, -1)[:, : qw.k].T).astype(np.float32)  # [N, K_pad] -> [K, N]
