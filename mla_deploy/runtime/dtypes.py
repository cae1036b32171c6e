"""Graph I/O arrays in every dtype the graphs take (the caches': io_spec.CacheFormat).

numpy has no bfloat16, so a bfloat16 cache is a uint16 array of its bit patterns (bfloat16 is float32's upper
half: `safetensors_io.bf16_to_float32` reads it), handed to onnxruntime as bfloat16. The runtime never does
arithmetic on caches, it only allocates, copies and binds them.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ..errors import ProviderError

NUMPY = {"int64": np.int64, "int8": np.int8, "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
_BFLOAT16 = 16  # ONNX TensorProto.BFLOAT16


def numpy_dtype(dtype: str) -> np.dtype:
    """A graph I/O dtype name -> the numpy dtype its arrays have here."""
    return np.dtype(NUMPY[dtype])


def ort_value(array: np.ndarray, dtype: str, device: str = "cpu") -> ort.OrtValue:
    """An OrtValue over `array` (no copy on the CPU) with the graph's element type `dtype`."""
    if dtype != "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy(array, device, 0)
    if device != "cpu":
        raise ProviderError(f"bfloat16 caches on {device}: this runtime binds them from host memory only; "
                            "export with --dtype float16 for CUDA")
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, _BFLOAT16)
