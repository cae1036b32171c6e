"""Graph I/O arrays in every dtype the graphs take (the caches': io_spec.CacheFormat).

numpy has no bfloat16, so a bfloat16 cache is a uint16 array of its bit patterns (bfloat16 is float32's upper
half: `safetensors_io.bf16_to_float32` reads it), handed to onnxruntime as bfloat16. The runtime allocates, copies
and binds caches; its one arithmetic on them is a cache shift's rotation of roped keys (runtime.cache), in float32.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ..errors import ProviderError
from ..safetensors_io import bf16_to_float32, float32_to_bf16

NUMPY = {"int64": np.int64, "int8": np.int8, "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
ONNX = {"int64": 7, "int8": 3, "float32": 1, "float16": 10, "bfloat16": 16}  # ONNX TensorProto element types
_BFLOAT16 = ONNX["bfloat16"]


def numpy_dtype(dtype: str) -> np.dtype:
    """A graph I/O dtype name -> the numpy dtype its arrays have here."""
    return np.dtype(NUMPY[dtype])


def as_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    """Float cache values of graph dtype `dtype` (bfloat16 as bit patterns) as float32."""
    return bf16_to_float32(array) if dtype == "bfloat16" else array.astype(np.float32)


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as a float cache of graph dtype `dtype` stores them, rounded to nearest (even)."""
    return float32_to_bf16(values) if dtype == "bfloat16" else values.astype(numpy_dtype(dtype))


def ort_value(array: np.ndarray, dtype: str, device: str = "cpu") -> ort.OrtValue:
    """An OrtValue with the graph's element type `dtype`: over `array` on the CPU (no copy), or a copy of it in
    `device` memory."""
    if device != "cpu":
        return to_device(array, dtype, device)
    if dtype != "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy(array)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, _BFLOAT16)


def device_value(shape: tuple[int, ...], dtype: str, device: str) -> ort.OrtValue:
    """A tensor that onnxruntime allocates in `device` memory ('cpu', 'cuda'), uninitialised."""
    try:
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), ONNX[dtype], device, 0)
    except Exception as e:  # onnxruntime's own error types: a build without the device's allocator
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ProviderError(f"cannot allocate a {dtype} tensor {list(shape)} on {device!r} with this onnxruntime "
                            f"build ({why})") from None


def to_device(array: np.ndarray, dtype: str, device: str) -> ort.OrtValue:
    """A copy of host `array` in `device` memory (one host-to-device transfer)."""
    value = device_value(array.shape, dtype, device)
    value.update_inplace(ort_value(np.ascontiguousarray(array), dtype))
    return value


def to_host(value: ort.OrtValue, dtype: str) -> np.ndarray:
    """A host copy of `value` (one device-to-host transfer), bfloat16 as its bit patterns."""
    array = np.empty(value.shape(), numpy_dtype(dtype))
    ort_value(array, dtype).update_inplace(value)
    return array
