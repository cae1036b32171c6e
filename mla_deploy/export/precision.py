"""`--dtype`: what an export stores its weights and caches in, and what its graphs compute in.

float32 computes in float32. float16 and bfloat16 store weights and caches in half precision but compute in
float32: onnxruntime 1.31's CPU provider has bfloat16 kernels only for data movement (Gather, Concat, Cast,
Reshape, Transpose, Split, TensorScatter), none for MatMul, Add, Mul, Softmax or RMSNormalization (measured per
op), and on a CPU without AVX512-FP16 it runs float16 MatMuls and their neighbours in float32 through casts it
inserts itself; every export must run on the CPU. So a half export halves the file and the caches. A float16
weight is multiplied as stored by mla_deploy.MatMulF16 (mla_deploy.kernels), where its library is registered;
elsewhere, and for bfloat16, onnxruntime widens the weights to float32 once at load (it folds the casts).

An export in a half dtype stands for the checkpoint with every weight rounded to that dtype (`round_weight`): the
graphs read the rounded values, including the weights kept in float32 for the float32 islands (norms, router,
the per-head and fused absorbed matrices, computed from the rounded factors), so `RoundedCheckpoint` is the exact
source it is verified against, as a quantized export's is its dequantized checkpoint.

`--compute float16` (export.plan) makes a float16 export compute in float16 outside those islands, every weight
multiplied as stored by onnxruntime's own ops: the form for a GPU, where the function bodies would multiply float32
copies.

In every dtype some math stays float32 (export.builder's float32 islands): RMSNorm statistics, rope, the attention
core and the router. The fused W^Q·W^UK product is where half precision overflows first. The plan (export.plan)
records the dtype, the compute dtype and the caches' dtype.
"""

from __future__ import annotations

import numpy as np

from ..checkpoint import CheckpointView
from ..errors import ExportError
from ..safetensors_io import bf16_to_float32, float32_to_bf16

DTYPES = ("float32", "float16", "bfloat16")
FLOAT16_MAX = float(np.finfo(np.float16).max)


def round_weight(w: np.ndarray, dtype: str, name: str = "weight") -> np.ndarray:
    """W (float32) rounded to `dtype` and widened back to float32: the values an export in that dtype computes with.
    A float16 weight beyond float16's range is refused by name (it would become inf)."""
    if dtype == "float32":
        return w
    if dtype == "float16":
        peak = float(np.abs(w).max(initial=0.0))
        if peak > FLOAT16_MAX:
            raise ExportError(f"--dtype float16: {name} holds |w| = {peak:.4g}, beyond float16's largest value "
                              f"{FLOAT16_MAX:g}; export it as bfloat16 or float32")
        return w.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        return bf16_to_float32(float32_to_bf16(w))
    raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")


class RoundedCheckpoint(CheckpointView):
    """A checkpoint whose weights read as rounded to `dtype` (round_weight): what a half-precision export stands for,
    and what it is verified against."""

    def __init__(self, ckpt, dtype: str):
        super().__init__(ckpt)
        self.dtype = dtype

    def tensor(self, name: str) -> np.ndarray:
        return round_weight(self.ckpt.tensor(name), self.dtype, name)
