"""mla-deploy's own onnxruntime kernels: a custom-op library built at install time (setup.py) from the C in this
directory. Torch-free; the runtime registers it on every session it creates.

`mla_deploy.MatMulF16` (half_matmul.c): a float16 MatMul that reads its float16 weight as stored and widens it in
registers. onnxruntime's CPU provider has no float16 MatMul without AVX512-FP16 and would cast the weight to a float32
copy at load, so a float16 export's decode step would read twice its file's bytes. Every graph that uses the op also
carries it as an ONNX function (Cast-free MatMul over the re-laid weight, export.layers), which onnxruntime runs
wherever the library is not registered: not built, a CPU without AVX2/FMA/F16C, or turned off
(RuntimeOptions.kernels).
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

import numpy as np

DOMAIN = "mla_deploy"
HALF_MATMUL = "MatMulF16"
STRIP = 64  # MatMulF16's weight layout: strips of 64 output columns, [N / 64, K, 64]


def library() -> Path | None:
    """The built custom-op library, or None where the install could not build it."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_half_matmul{suffix}"
        if path.is_file():
            return path
    return None


def column_strips(w_in_out: np.ndarray) -> np.ndarray:
    """W [K, N] (N a multiple of 64) as MatMulF16 reads it, strips of 64 columns [N / 64, K, 64]: a view, written
    strip by strip. B[s, k, j] = W[k, 64 s + j]."""
    k, n = w_in_out.shape
    if n % STRIP:
        raise ValueError(f"column_strips: N = {n} is not a multiple of {STRIP}")
    return w_in_out.reshape(k, n // STRIP, STRIP).transpose(1, 0, 2)  # [K, N] -> [K, N/64, 64] -> [N/64, K, 64]
