"""Shared by the quantized kernels' tests: one-op ONNX models carrying mla_deploy's quantized ops with their
function bodies, sessions at a forced instruction-set level, and float64 references of what each op computes."""

from __future__ import annotations


import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import kernel_levels
from mla_deploy import kernels
from mla_deploy.export import layouts
from mla_deploy.export.opset import IR_VERSION, OPSET
from mla_deploy.export.quantize import quantize, unpack_codes
from mla_deploy.export.linear import qbatch_matmul_function, qmatmul_function

U = 2.0**-24  # float32's unit roundoff


def has_level(isa: str) -> bool:
    """Whether this CPU runs MLA_DEPLOY_ISA level `isa` (tests/kernel_levels.py reads the cpuid flags)."""
    return kernels.ISA_LEVELS.index(isa) <= kernels.ISA_LEVELS.index(kernel_levels.cpu_level())


def model(op: str, inputs: list, initializers: dict[str, np.ndarray], function, **attributes) -> bytes:
    """Y = mla_deploy.<op>(inputs..., initializers...) carrying `function` as its body."""
    node = helper.make_node(
        op, [i.name for i in inputs] + list(initializers), ["Y"], domain=kernels.DOMAIN, **attributes
    )
    graph = helper.make_graph([node], "one_op", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()])
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(kernels.DOMAIN, 1)],
        functions=[ir.serde.serialize_function(function)],
        ir_version=IR_VERSION,
    ).SerializeToString()


def session(onnx_model: bytes, library: bool, threads: int = 2) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    if library:
        so.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(onnx_model, so, providers=["CPUExecutionProvider"])


def quantized(w: np.ndarray, bits: int, block: int):
    """(QuantizedWeight, codes, scales) of W [K, N] in the kernels' layout."""
    qw = quantize(w, bits, block, scale_dtype="float16")
    return (qw, *layouts.qmatmul_layout(qw))


def qmatmul_model(k: int, n: int, bits: int, block: int, level: int, codes, scales, a_shape=None) -> bytes:
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, a_shape or ["M", k])
    return model(kernels.QMATMUL[bits], [a], {"codes": codes, "scales": scales}, qmatmul_function(bits),
                 K=k, N=n, block_size=block, accuracy_level=level)


def qbatch_matmul_model(k: int, n: int, bits: int, block: int, level: int, codes, scales, a_shape=None) -> bytes:
    """QBatchMatMul of A [M, H, K] over codes [H, G, KB, ·] and scales [H, G, KB, 16] (one weight per head, stacked)."""
    a = helper.make_tensor_value_info("A", TensorProto.FLOAT, a_shape or ["M", codes.shape[0], k])
    return model(kernels.QBATCH_MATMUL[bits], [a], {"codes": codes, "scales": scales}, qbatch_matmul_function(bits),
                 K=k, N=n, block_size=block, accuracy_level=level)


def quantize_rows(a: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' int8 activations of rows a [M, K]: codes [M, KB, B] (float64 holding integers) and scales [M, KB],
    computed in float32 as qmatmul_quantize_row does (scale max|a| / 127, codes rint(a · (127 / max|a|)))."""
    m, k = a.shape
    kb = -(-k // block)
    padded = np.zeros((m, kb * block), np.float32)
    padded[:, :k] = a
    blocks = padded.reshape(m, kb, block)
    amax = np.abs(blocks).max(-1)
    scalable = amax > np.float32(127) / np.finfo(np.float32).max  # else 127 / amax overflows: the block is zeros
    inv = np.where(scalable, np.float32(127) / np.where(scalable, amax, np.float32(1)), np.float32(0)).astype(
        np.float32
    )
    codes = np.rint(blocks * inv[..., None])
    return codes.astype(np.float64), (amax / np.float32(127)).astype(np.float32)


def signed_codes(qw) -> np.ndarray:
    return unpack_codes(qw).astype(np.float64)  # [N, KB, B]


def level4_terms(a: np.ndarray, qw) -> np.ndarray:
    """Per row, column and block: float32(w_scale · a_scale) · sum of a_code · w_code, [M, N, KB] float64; the
    kernels add these in block order."""
    codes, a_scale = quantize_rows(a, qw.block)
    sums = np.einsum("mjb,njb->mnj", codes, signed_codes(qw))
    factors = (qw.scales.astype(np.float32)[None, :, :] * a_scale[:, None, :]).astype(np.float32)  # [M, N, KB]
    return sums * factors.astype(np.float64)


def activation_error_bound(a: np.ndarray, w_deq: np.ndarray, block: int) -> np.ndarray:
    """How far int8 activations can move A @ W': each activation by at most half its block's step (max|a| / 254, and
    float32's rounding of a · 127 / max|a| besides), times |W'|: [M, N]."""
    _, a_scale = quantize_rows(a, block)
    step = np.repeat(a_scale.astype(np.float64), block, axis=1)[:, : a.shape[1]]  # [M, K]
    return (step * (0.5 + 1e-5)) @ np.abs(w_deq.astype(np.float64))
