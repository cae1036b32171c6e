"""The ONNX function bodies of mla-deploy's custom ops (mla_deploy.kernels): every graph that uses an op carries its
body, which onnxruntime inlines and runs wherever the kernel library is not registered (no C compiler at install, a
CPU without AVX2/FMA/F16C, RuntimeOptions(kernels=False), CUDA). Each computes what its kernel computes, from the
same inputs, with standard ops; the weight re-layouts and casts depend only on initializers, so onnxruntime folds
them once at load.
"""

from __future__ import annotations

import functools

import onnx
import onnx_ir as ir

from .. import kernels
from .opset import OPSET


@functools.cache
def _half_matmul_proto(dtype: str) -> onnx.FunctionProto:
    h = onnx.helper
    return h.make_function(kernels.DOMAIN, kernels.HALF_MATMUL[dtype], ["A", "B"], ["Y"], [
        h.make_node("Transpose", ["B"], ["B_k"], perm=[1, 0, 2]),  # [N/64, K, 64] -> [K, N/64, 64]
        h.make_node("Constant", [], ["k_by_n"], value_ints=[0, -1]),
        h.make_node("Reshape", ["B_k", "k_by_n"], ["W16"]),  # [K, N/64, 64] -> [K, N]
        h.make_node("Cast", ["W16"], ["W"], to=onnx.TensorProto.FLOAT),
        h.make_node("MatMul", ["A", "W"], ["Y"]),  # [..., K] float32 @ [K, N] -> [..., N] float32
    ], opset_imports=[h.make_opsetid("", OPSET)],
        doc_string=f"Y = A @ W for float32 A and a {dtype} W stored as column strips B [N/64, K, 64]; mla-deploy's "
                   "kernel library (mla_deploy.kernels) runs it reading W as stored, this body where that is not registered.")


def _widened(dtype: str, *names: str) -> tuple[list[onnx.NodeProto], list[str]]:
    """Cast nodes taking `names` (of `dtype`) to float32, and the names to use after them: none for float32."""
    if dtype == "float32":
        return [], list(names)
    return [onnx.helper.make_node("Cast", [n], [f"{n}_f"], to=onnx.TensorProto.FLOAT) for n in names], [f"{n}_f" for n in names]


@functools.cache
def _routed_experts_proto(dtype: str) -> onnx.FunctionProto:
    h = onnx.helper
    node = h.make_node
    widen, (fc1, fc2) = _widened(dtype, "fc1", "fc2")
    return h.make_function(kernels.DOMAIN, kernels.ROUTED_EXPERTS[dtype], ["X", "dispatch", "fc1", "fc2"], ["Y"], [
        *widen,
        node("Transpose", [fc1], ["fc1_d"], perm=[0, 2, 1, 3]),  # [E, J, d, 64] -> [E, d, J, 64]
        node("Constant", [], ["gate_up_shape"], value_ints=[0, 0, 0, 2, kernels.GATE_UP]),
        node("Reshape", ["fc1_d", "gate_up_shape"], ["gate_up"]),  # [E, d, J, 64] -> [E, d, J, 2, 32]
        node("Constant", [], ["zero"], value_int=0),
        node("Constant", [], ["one"], value_int=1),
        node("Gather", ["gate_up", "zero"], ["gate_j"], axis=3),  # [E, d, J, 32]
        node("Gather", ["gate_up", "one"], ["up_j"], axis=3),  # [E, d, J, 32]
        node("Constant", [], ["e_d_i"], value_ints=[0, 0, -1]),
        node("Reshape", ["gate_j", "e_d_i"], ["gate"]),  # [E, d, J, 32] -> [E, d, I']
        node("Reshape", ["up_j", "e_d_i"], ["up"]),  # [E, d, J, 32] -> [E, d, I']
        node("MatMul", ["X", "gate"], ["g"]),  # [T, d] @ [E, d, I'] -> [E, T, I']
        node("MatMul", ["X", "up"], ["u"]),  # [E, T, I']
        node("Sigmoid", ["g"], ["sig"]),
        node("Mul", ["g", "sig"], ["silu"]),
        node("Mul", ["silu", "u"], ["act"]),  # silu(gate) · up [E, T, I']
        node("Transpose", [fc2], ["fc2_i"], perm=[0, 2, 1, 3]),  # [E, S, I', 64] -> [E, I', S, 64]
        node("Reshape", ["fc2_i", "e_d_i"], ["down"]),  # [E, I', S, 64] -> [E, I', d']
        node("MatMul", ["act", "down"], ["y_e"]),  # [E, T, d']
        node("Transpose", ["dispatch"], ["dispatch_e"], perm=[1, 0]),  # [T, E] -> [E, T]
        node("Constant", [], ["last"], value_ints=[-1]),
        node("Unsqueeze", ["dispatch_e", "last"], ["w"]),  # [E, T] -> [E, T, 1]
        node("Mul", ["y_e", "w"], ["weighted"]),
        node("Constant", [], ["experts_axis"], value_ints=[0]),
        node("ReduceSum", ["weighted", "experts_axis"], ["y_padded"], keepdims=0),  # [T, d']
        node("Shape", ["X"], ["d"], start=1),  # [1]
        node("Constant", [], ["start"], value_ints=[0]),
        node("Constant", [], ["columns"], value_ints=[1]),
        node("Slice", ["y_padded", "start", "d", "columns"], ["Y"]),  # [T, d'] -> [T, d]
    ], opset_imports=[h.make_opsetid("", OPSET)],
        doc_string=f"Y = sum_e dispatch[:, e] · down_e(silu(gate_e X) · up_e X) over {dtype} fc1 [E, I'/32, d, 64] and "
                   "fc2 [E, d'/64, I', 64] (mla_deploy.kernels.expert_fc1_strips / expert_fc2_strips). mla-deploy's kernel "
                   "library runs only each expert's own tokens; this body, where that is not registered, runs every "
                   "expert on every token (weights re-laid out and folded at load).")


@functools.cache
def _latent_attention_proto(dtype: str, long: bool) -> onnx.FunctionProto:
    h = onnx.helper
    node = h.make_node
    widen, (latent, rope) = _widened(dtype, "latent", "rope")
    scores = [
        node("Transpose", ["q_latent"], ["q_latent_t"], perm=[0, 2, 1]),  # [b, h, d_c] -> [b, d_c, h]
        node("Transpose", ["q_rope"], ["q_rope_t"], perm=[0, 2, 1]),  # [b, h, d_r] -> [b, d_r, h]
        node("MatMul", [latent, "q_latent_t"], ["latent_scores"]),  # [b, cap, d_c] @ [b, d_c, h] -> [b, cap, h]
        node("MatMul", [rope, "q_rope_t"], ["rope_scores"]),  # [b, cap, d_r] @ [b, d_r, h] -> [b, cap, h]
        node("Add", ["latent_scores", "rope_scores"], ["scores"]),
    ]
    if long:  # MLAS packs a MatMul's B on every call: a long cache stays the A operand (layers.MLAttention._probs_at_latent)
        mixture = [
            node("Constant", [], ["column_shape"], value_ints=[0, -1, 1]),
            node("Reshape", ["bias", "column_shape"], ["bias_column"]),  # [b, 1, 1, cap] -> [b, cap, 1]
            node("Add", ["scores", "bias_column"], ["logits"]),
            node("Softmax", ["logits"], ["probs"], axis=1),  # over the cache [b, cap, h]
            node("FusedMatMul", [latent, "probs"], ["out_t"], domain="com.microsoft", transA=1),  # [b, d_c, h]
            node("Transpose", ["out_t"], ["out"], perm=[0, 2, 1]),  # [b, d_c, h] -> [b, h, d_c]
        ]
    else:
        mixture = [
            node("Transpose", ["scores"], ["scores_t"], perm=[0, 2, 1]),  # [b, cap, h] -> [b, h, cap]
            node("Constant", [], ["row_shape"], value_ints=[0, 1, -1]),
            node("Reshape", ["bias", "row_shape"], ["bias_rows"]),  # [b, 1, 1, cap] -> [b, 1, cap]
            node("Add", ["scores_t", "bias_rows"], ["logits"]),
            node("Softmax", ["logits"], ["probs"], axis=-1),  # [b, h, cap]
            node("MatMul", ["probs", latent], ["out"]),  # [b, h, cap] @ [b, cap, d_c] -> [b, h, d_c]
        ]
    names = kernels.LATENT_ATTENTION_LONG if long else kernels.LATENT_ATTENTION
    opsets = [h.make_opsetid("", OPSET)] + ([h.make_opsetid("com.microsoft", 1)] if long else [])
    return h.make_function(kernels.DOMAIN, names[dtype], ["q_latent", "q_rope", "latent", "rope", "bias"], ["out"],
                           [*widen, *scores, *mixture], opset_imports=opsets,
                           doc_string=f"out = softmax(q_latent · latent + q_rope · rope + bias) @ latent over {dtype} "
                                      "caches (the queries already scaled). mla-deploy's kernel library reads the "
                                      "caches as stored and only the slots each row sees; this body, where that is "
                                      "not registered, reads every slot" + (", the cache as the A operand" if long else ""))


def latent_attention_function(dtype: str = "float32", long: bool = False) -> ir.Function:
    """The body of mla_deploy.LatentAttention for `dtype` caches (LatentAttentionLong: a cache that can outgrow
    layers.LONG_CACHE_BYTES a row, multiplied as MatMul's A operand): what onnxruntime runs where the kernel library
    is not registered."""
    return ir.serde.deserialize_function(_latent_attention_proto(dtype, long))


def routed_experts_function(dtype: str = "float32") -> ir.Function:
    """The body of mla_deploy.RoutedExperts for `dtype` weights (float32, float16, bfloat16): what onnxruntime runs
    where the kernel library is not registered."""
    return ir.serde.deserialize_function(_routed_experts_proto(dtype))


def half_matmul_function(dtype: str) -> ir.Function:
    """The body of mla_deploy's MatMul by a `dtype` (float16, bfloat16) weight: what onnxruntime runs where the kernel
    library is not registered (it folds the weight's re-layout and cast at load into a float32 copy)."""
    return ir.serde.deserialize_function(_half_matmul_proto(dtype))
