"""mla-deploy's own onnxruntime kernels: a custom-op library built at install time (setup.py) from the C in this
directory. Torch-free; the runtime registers it on every session it creates (RuntimeOptions.kernels).

`mla_deploy.MatMulF16` and `mla_deploy.MatMulBF16` (half_matmul.c, registered by custom_ops.c): Y = A @ W for
float32 A and Y and a float16 or bfloat16 weight W, read as stored and widened in registers. onnxruntime's CPU
provider has no MatMul for either weight type (float16: without AVX512-FP16) and would multiply by float32 copies
made at load, so a half export's decode step would read twice its file's bytes. Every graph that uses the ops also
carries them as ONNX functions (the same product through Cast and MatMul, export.layers), which onnxruntime runs
wherever the library is not registered: not built (no C compiler), a CPU without AVX2/FMA/F16C, or turned off.
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

import numpy as np

DOMAIN = "mla_deploy"
HALF_MATMUL = {"float16": "MatMulF16", "bfloat16": "MatMulBF16"}  # by the weight's dtype
STRIP = 64  # their weight layout: strips of 64 output columns, [N / 64, K, 64]


def library() -> Path | None:
    """The built custom-op library, or None where the install could not build it."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_half_matmul{suffix}"
        if path.is_file():
            return path
    return None


def column_strips(w_in_out: np.ndarray) -> np.ndarray:
    """W [K, N] (N a multiple of 64) as MatMulF16 / MatMulBF16 read it, strips of 64 columns [N / 64, K, 64]: a view, written
    strip by strip. B[s, k, j] = W[k, 64 s + j]."""
    k, n = w_in_out.shape
    if n % STRIP:
        raise ValueError(f"column_strips: N = {n} is not a multiple of {STRIP}")
    return w_in_out.reshape(k, n // STRIP, STRIP).transpose(1, 0, 2)  # [K, N] -> [K, N/64, 64] -> [N/64, K, 64]
