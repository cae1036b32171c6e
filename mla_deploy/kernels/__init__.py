"""mla-deploy's own onnxruntime kernels: a custom-op library built at install time (setup.py) from the C in this
directory. Torch-free; the runtime registers it on every session it creates (RuntimeOptions.kernels).

`mla_deploy.MatMulF16` and `mla_deploy.MatMulBF16` (strip_matmul.c, registered by custom_ops.c): Y = A @ W for
float32 A and Y and a float16 or bfloat16 weight W, read as stored and widened in registers. onnxruntime's CPU
provider has no MatMul for either weight type (float16: without AVX512-FP16) and would multiply by float32 copies
made at load, so a half export's decode step would read twice its file's bytes.

`mla_deploy.RoutedExperts` (routed_experts.c; `RoutedExpertsF16` / `RoutedExpertsBF16` for half weights): a MoE
layer's routed experts, each on the tokens that chose it, weighted by the router's dispatch [T, E] (0 where a token
did not choose the expert). onnxruntime's MoE op does the same grouping but re-packs each expert's matrix on every
call once the expert has two tokens, and multiplies float32 only; this op reads strips laid out at export
(`expert_fc1_strips`, `expert_fc2_strips`) as they are stored.

`mla_deploy.LatentAttention` (latent_attention.c; `LatentAttentionF16` / `LatentAttentionBF16` for half caches): the
absorbed decode attention's core, softmax(q_latent · latent + q_rope · rope + bias) @ latent, reading the caches as
stored and only the slots each row sees (export.plan chooses it). `LatentAttentionAvx512` (and its Long form) is
the float32 kernel under a name registered only where the kernels run AVX-512 code (`isa()`): elsewhere onnxruntime
runs its body, its own MatMuls.

`mla_deploy.QMatMul4` / `QMatMul6` / `QMatMul8` (qmatmul.c): Y [..., N] = A [..., K] @ W for an int4 / int6 / int8
block-quantized W (int6: a head at llama.cpp's q6_K size)
read where it lies in the mapped weights.bin: inputs A (float32), codes (uint8 [G, KB, 2·B·bits]) and scales
(float16 [G, KB, 16]) in export.layouts' layout (16-column groups, per group and block one contiguous run), attributes
K, N, block_size (16, 32, 64, 128) and accuracy_level (0: float activations, exact against the dequantized weight up to
float32 rounding; 4: A's rows quantized to int8 per block on the fly, integer dot products with AVX-512 VNNI or AVX2,
MatMulNBits' meaning). onnxruntime's MatMulNBits prepacks a private copy of its weight in every session; these ops
read the file's one copy from every session that maps it. `QRoutedExperts4` / `QRoutedExperts8` (qexperts.c): a MoE
layer's routed experts over such weights (export.layouts.routed_experts_layout), each expert reading only its own
tokens' rows; `QGather4` / `QGather6` / `QGather8` (qgather.c): columns of such a W dequantized, so that a tied
embedding is read from its head's codes, and a separate table stored as Eᵀ costs no second layout.
Their function bodies (export.linear, export.moe over export.dequantize) are stock ONNX over the same initializers: Cast
the codes, split int4 nibbles as floor(x / 16) and x - 16 floor(x / 16) (int6: plus 16 times the high part's 2-bit
fields floor(x / 4^i) mod 4), Reshape to [G, KB, B/4, 16, 4], subtract the
zero point 2^(bits-1), multiply by the scales reshaped [G, KB, 1, 16, 1], Transpose to [KB, B/4, 4, G, 16] and Reshape
to [KB·B, 16 G] (W zero-padded), Slice N columns and MatMul by A zero-padded to KB·B (at accuracy_level 4 quantized and
dequantized per block first, as the kernels quantize it), so they run on plain onnxruntime and on CUDA.

Every graph that uses the ops also carries them as ONNX functions, built from the graph code that computes the same
math (export.linear, export.moe, export.attention: the same product through Cast and MatMul; every expert on every
token, weighted by dispatch; MatMul, Softmax, MatMul), which onnxruntime runs wherever the library is not
registered: not built (no C compiler), or turned off.

Each op has a plain C path beside its AVX2 and AVX-512 ones, so the library registers on any x86-64 CPU;
MLA_DEPLOY_ISA=scalar|avx2|avx512 (dispatch.h) caps the path a session's kernels take, read as onnxruntime creates
them.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import warnings
from pathlib import Path

import numpy as np

from ..errors import MLADeployError

DOMAIN = "mla_deploy"
HALF_MATMUL = {"float16": "MatMulF16", "bfloat16": "MatMulBF16"}  # by the weight's dtype
ROUTED_EXPERTS = {
    "float32": "RoutedExperts",
    "float16": "RoutedExpertsF16",
    "bfloat16": "RoutedExpertsBF16",
}  # by weight dtype
STRIP = 64  # their weight layout: strips of 64 output columns, [N / 64, K, 64]
LATENT_ATTENTION = {
    "float32": "LatentAttention",
    "float16": "LatentAttentionF16",
    "bfloat16": "LatentAttentionBF16",
}  # by cache dtype
# the same kernel, for caches that can outgrow export.plan.LONG_CACHE_BYTES a row: only their function bodies differ
LATENT_ATTENTION_LONG = {dtype: name.replace("Attention", "AttentionLong") for dtype, name in LATENT_ATTENTION.items()}
# the same kernel for T query tokens a row [b, T, h, ·] (the verify and draft graphs)
LATENT_ATTENTION_CHUNK = {
    dtype: name.replace("Attention", "AttentionChunk") for dtype, name in LATENT_ATTENTION.items()
}
# the float32 kernel under names the library registers only where its kernels run AVX-512 code (elsewhere
# onnxruntime runs their function bodies: export.plan's decode attention "avx512"), by the long-cache form; and for
# T query tokens a row (the verify and draft graphs)
LATENT_ATTENTION_AVX512 = {False: "LatentAttentionAvx512", True: "LatentAttentionLongAvx512"}
LATENT_ATTENTION_CHUNK_AVX512 = "LatentAttentionChunkAvx512"
# over an int8 latent cache with a scale per entry, by the rope cache's dtype (latent_attention_q8.c)
LATENT_ATTENTION_Q8 = {
    "float32": "LatentAttentionQ8",
    "float16": "LatentAttentionQ8F16",
    "bfloat16": "LatentAttentionQ8BF16",
}
LATENT_ATTENTION_LONG_Q8 = {
    dtype: name.replace("Attention", "AttentionLong") for dtype, name in LATENT_ATTENTION_Q8.items()
}
# the same kernel for a prefill chunk's queries [b, T, h, ·] over an int8 latent cache
LATENT_ATTENTION_CHUNK_Q8 = {
    dtype: name.replace("Attention", "AttentionChunk") for dtype, name in LATENT_ATTENTION_Q8.items()
}
GATE_UP = 32  # RoutedExperts' fc1 strip: 32 gate columns, then the same 32 columns of up
# the quantized ops, by their weights' bits (their layout: export.layouts)
QMATMUL = {4: "QMatMul4", 6: "QMatMul6", 8: "QMatMul8"}
QBATCH_MATMUL = {4: "QBatchMatMul4", 8: "QBatchMatMul8"}  # one weight per head: A [M, H, K] -> [M, H, N]
QROUTED_EXPERTS = {4: "QRoutedExperts4", 8: "QRoutedExperts8"}
QGATHER = {4: "QGather4", 6: "QGather6", 8: "QGather8"}
ISA_LEVELS = ("scalar", "avx2", "avx512")  # MLA_DEPLOY_ISA's values, each level including the ones before it


def library() -> Path | None:
    """The built custom-op library, or None where the install could not build it. A MLA_DEPLOY_ISA the library
    would not know (it would run the CPU's own level, unsaid) is refused."""
    cap = os.environ.get("MLA_DEPLOY_ISA")
    if cap and cap not in ISA_LEVELS:
        raise MLADeployError(f"MLA_DEPLOY_ISA={cap}: expected one of {', '.join(ISA_LEVELS)} (unset: the CPU's "
                             "highest level)")
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_kernels{suffix}"
        if path.is_file():
            return path
    return None


def isa() -> str | None:
    """The instruction-set level the library's kernels run in this process (the CPU's, capped by MLA_DEPLOY_ISA), as
    dispatch.c decides it; None where the library was not built, or was built from sources without MlaDeployIsa
    (rebuild it: `pip install -e .` or `python setup.py build_ext --inplace`)."""
    path = library()
    level = getattr(ctypes.CDLL(str(path)), "MlaDeployIsa", None) if path is not None else None
    return None if level is None else ISA_LEVELS[level()]


def warn_above_cpu() -> None:
    """A RuntimeWarning where MLA_DEPLOY_ISA asks for a level this CPU does not have: the cap never raises the
    level, so the kernels run the CPU's own (a forced-path test or benchmark would otherwise measure another path
    than it names)."""
    cap = os.environ.get("MLA_DEPLOY_ISA")
    level = isa() if cap in ISA_LEVELS else None
    if level is not None and ISA_LEVELS.index(level) < ISA_LEVELS.index(cap):
        warnings.warn(f"MLA_DEPLOY_ISA={cap}: this CPU lacks the {cap} path; the kernels run {level}, its highest",
                      RuntimeWarning, stacklevel=2)


def column_strips(w_in_out: np.ndarray) -> np.ndarray:
    """W [K, N] (N a multiple of 64) as MatMulF16 / MatMulBF16 read it, strips of 64 columns [N / 64, K, 64]: a view,
    written strip by strip. B[s, k, j] = W[k, 64 s + j]."""
    k, n = w_in_out.shape
    if n % STRIP:
        raise ValueError(f"column_strips: N = {n} is not a multiple of {STRIP}")
    return w_in_out.reshape(k, n // STRIP, STRIP).transpose(1, 0, 2)  # [K, N] -> [K, N/64, 64] -> [N/64, K, 64]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def expert_fc1_strips(gate_out_in: np.ndarray, up_out_in: np.ndarray) -> np.ndarray:
    """One expert's gate and up (HF [I, d] each) as RoutedExperts' fc1 [I' / 32, d, 64]: strip j holds gate's
    columns 32 j .. 32 j + 31 of x @ gateᵀ, then up's same columns; I' is I rounded up to 32, its padding zero."""
    inter, d = gate_out_in.shape
    padded = _round_up(inter, GATE_UP)
    both = np.zeros((2, padded, d), np.float32)
    both[0, :inter], both[1, :inter] = gate_out_in, up_out_in
    both = both.reshape(2, padded // GATE_UP, GATE_UP, d)  # [2, I', d] -> [2, J, 32, d]
    return both.transpose(1, 3, 0, 2).reshape(padded // GATE_UP, d, STRIP)  # [J, d, 2, 32] -> [J, d, 64]


def expert_fc2_strips(down_out_in: np.ndarray) -> np.ndarray:
    """One expert's down (HF [d, I]) as RoutedExperts' fc2 [d' / 64, I', 64]: downᵀ [I, d] zero-padded to
    [I', d'] (I' = I rounded up to 32, as in fc1; d' = d rounded up to 64) in column strips."""
    d, inter = down_out_in.shape
    w = np.zeros((_round_up(inter, GATE_UP), _round_up(d, STRIP)), np.float32)
    w[:inter, :d] = down_out_in.T
    return np.ascontiguousarray(column_strips(w))
