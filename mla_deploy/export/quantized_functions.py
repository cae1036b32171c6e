"""The ONNX function bodies of mla-deploy's quantized ops (mla_deploy.kernels: QMatMul4/8, QRoutedExperts4/8,
QGather4/8), in stock ONNX only (Cast, Floor, Reshape, Transpose, Gather, MatMul, ...), so a graph that uses the ops
runs on plain onnxruntime (CPU or CUDA) where the kernel library is not registered. Each reads the same initializers
as its kernel (export.layouts) and computes what the kernel computes:

- the weight dequantized: (code - z) · scale, laid out back to W [K_pad, N] (export.layouts' recipe); onnxruntime
  folds this at load into a float32 copy, which is the fallback's price;
- accuracy_level 4: each row of activations quantized per block as the kernel does (a_s = max|a| / 127, codes
  rint(a · 127 / max|a|)) and dequantized before a float MatMul, so body and kernel multiply the same values and
  differ by float32 rounding only; accuracy_level 0: the float activations.
"""

from __future__ import annotations

import functools

import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from .. import kernels
from .opset import OPSET

node = helper.make_node


def _ints(name: str, values: list[int]) -> onnx.NodeProto:
    return node("Constant", [], [name], value_ints=values)


def _attribute(name: str, attribute: str) -> list[onnx.NodeProto]:
    """The function's integer attribute `attribute` as a 1-element int64 tensor `name`."""
    constant = node("Constant", [], [name + "_scalar"])
    constant.attribute.append(onnx.AttributeProto(name="value_int", ref_attr_name=attribute, type=onnx.AttributeProto.INT))
    return [constant, _ints(name + "_one", [1]), node("Reshape", [name + "_scalar", name + "_one"], [name])]


def _dequantized(codes: str, scales: str, bits: int, out: str, lead: int) -> list[onnx.NodeProto]:
    """`codes` [*lead, G, KB, 2·B·bits] and `scales` [*lead, G, KB, 16] -> `out` [*lead, KB·B, 16 G] float32."""
    keep = [0] * (lead + 2)  # Reshape's 0: the lead axes, G and KB as they are
    p = f"{out}_"
    nodes = [node("Cast", [codes], [p + "x"], to=TensorProto.FLOAT)]
    if bits == 4:  # byte 64 p + i: quad 2p in its low nibble, quad 2p + 1 in its high one
        nodes += [
            _ints(p + "pieces", keep + [-1, 1, 64]),
            node("Reshape", [p + "x", p + "pieces"], [p + "bytes"]),  # [.., G, KB, B/8, 1, 64]
            node("Constant", [], [p + "sixteenth"], value_float=1 / 16),
            node("Constant", [], [p + "sixteen"], value_float=16.0),
            node("Mul", [p + "bytes", p + "sixteenth"], [p + "high_f"]),
            node("Floor", [p + "high_f"], [p + "high"]),
            node("Mul", [p + "high", p + "sixteen"], [p + "high16"]),
            node("Sub", [p + "bytes", p + "high16"], [p + "low"]),
            node("Concat", [p + "low", p + "high"], [p + "nibbles"], axis=-2),  # [.., G, KB, B/8, 2, 64]
        ]
        unpacked = p + "nibbles"
    else:
        unpacked = p + "x"
    zero = float(2 ** (bits - 1))
    perm = list(range(lead)) + [lead + 1, lead + 2, lead + 4, lead, lead + 3]  # [.., KB, B/4, 4, G, 16]
    return nodes + [
        _ints(p + "quads", keep + [-1, 16, 4]),
        node("Reshape", [unpacked, p + "quads"], [p + "u"]),  # [.., G, KB, B/4, 16, 4]
        node("Constant", [], [p + "zero"], value_float=zero),
        node("Sub", [p + "u", p + "zero"], [p + "q"]),
        node("Cast", [scales], [p + "s"], to=TensorProto.FLOAT),
        _ints(p + "scale_shape", keep + [1, 16, 1]),
        node("Reshape", [p + "s", p + "scale_shape"], [p + "s5"]),  # [.., G, KB, 1, 16, 1]
        node("Mul", [p + "q", p + "s5"], [p + "w"]),
        node("Transpose", [p + "w"], [p + "wt"], perm=perm),
        node("Shape", [codes], [p + "g"], start=lead, end=lead + 1),
        _ints(p + "cols", [16]),
        node("Mul", [p + "g", p + "cols"], [p + "n_pad"]),
        _ints(p + "rows_shape", [0] * lead + [-1]),
        node("Concat", [p + "rows_shape", p + "n_pad"], [p + "w_shape"], axis=0),
        node("Reshape", [p + "wt", p + "w_shape"], [out]),  # [.., KB·B, 16 G]
    ]


def _activations(x: str, out: str, k_pad: str, rank: int) -> list[onnx.NodeProto]:
    """`x` [..., K] (rank `rank`) zero-padded to `k_pad` [1] values, then at accuracy_level 4 quantized per block of
    block_size as the kernels do and dequantized: `out` [..., K_pad] float32."""
    p = f"{out}_"
    return [
        node("Shape", [x], [p + "k"], start=-1),
        node("Sub", [k_pad, p + "k"], [p + "extra"]),
        _ints(p + "no_pads", [0] * (2 * rank - 1)),
        node("Concat", [p + "no_pads", p + "extra"], [p + "pads"], axis=0),
        node("Pad", [x, p + "pads"], [p + "padded"]),  # [..., K_pad]
        *_attribute(p + "block", "block_size"),
        _ints(p + "lead", [0] * (rank - 1) + [-1]),
        node("Concat", [p + "lead", p + "block"], [p + "block_shape"], axis=0),
        node("Reshape", [p + "padded", p + "block_shape"], [p + "blocks"]),  # [..., KB, B]
        node("Abs", [p + "blocks"], [p + "abs"]),
        _ints(p + "last", [-1]),
        node("ReduceMax", [p + "abs", p + "last"], [p + "amax"], keepdims=1),
        node("Constant", [], [p + "qmax"], value_float=127.0),
        node("Constant", [], [p + "zero"], value_float=0.0),
        node("Div", [p + "qmax", p + "amax"], [p + "inv_raw"]),
        node("Equal", [p + "amax", p + "zero"], [p + "empty"]),
        node("Where", [p + "empty", p + "zero", p + "inv_raw"], [p + "inv"]),  # an all-zero block codes as zero
        node("Mul", [p + "blocks", p + "inv"], [p + "scaled"]),
        node("Round", [p + "scaled"], [p + "codes"]),  # half to even, as the kernels' cvtps2dq
        node("Div", [p + "amax", p + "qmax"], [p + "a_s"]),
        node("Mul", [p + "codes", p + "a_s"], [p + "dq"]),
        node("Shape", [p + "padded"], [p + "padded_shape"]),
        node("Reshape", [p + "dq", p + "padded_shape"], [p + "quantized"]),
        *_attribute(p + "level", "accuracy_level"),
        _ints(p + "four", [4]),
        node("Equal", [p + "level", p + "four"], [p + "int8"]),
        node("Where", [p + "int8", p + "quantized", p + "padded"], [out]),
    ]


def _k_pad(codes: str, out: str, axis: int) -> list[onnx.NodeProto]:
    """KB · block_size as a [1] tensor, KB from `codes`' axis `axis`."""
    return [node("Shape", [codes], [out + "_kb"], start=axis, end=axis + 1), *_attribute(out + "_b", "block_size"),
            node("Mul", [out + "_kb", out + "_b"], [out])]


def _level_attributes() -> list[onnx.AttributeProto]:
    return [helper.make_attribute("accuracy_level", 0)]


@functools.cache
def _qmatmul_proto(bits: int) -> onnx.FunctionProto:
    nodes = [
        *_attribute("k", "K"),
        _ints("minus_one", [-1]),
        node("Concat", ["minus_one", "k"], ["a_shape"], axis=0),
        node("Reshape", ["A", "a_shape"], ["A2"]),  # [M, K]
        *_k_pad("codes", "k_pad", 1),
        *_activations("A2", "A_q", "k_pad", 2),
        *_dequantized("codes", "scales", bits, "W_pad", 0),  # [K_pad, N_pad]
        *_attribute("n", "N"),
        _ints("zero", [0]),
        _ints("one", [1]),
        node("Slice", ["W_pad", "zero", "n", "one"], ["W"]),  # [K_pad, N]
        node("MatMul", ["A_q", "W"], ["Y2"]),  # [M, N]
        node("Shape", ["A"], ["lead"], end=-1),
        node("Concat", ["lead", "n"], ["y_shape"], axis=0),
        node("Reshape", ["Y2", "y_shape"], ["Y"]),
    ]
    return helper.make_function(
        kernels.DOMAIN, kernels.QMATMUL[bits], ["A", "codes", "scales"], ["Y"], nodes,
        opset_imports=[helper.make_opsetid("", OPSET)], attributes=["K", "N", "block_size"],
        attribute_protos=_level_attributes(),
        doc_string=f"Y = A @ W for float32 A [..., K] and an int{bits} W [K, N] in mla-deploy's quantized layout "
                   "(export.layouts: codes [G, KB, 2·B·bits], float16 scales [G, KB, 16]); accuracy_level 4 quantizes "
                   "A's rows per block to int8 first, as the kernel library (mla_deploy.kernels) does reading W as stored.")


@functools.cache
def _qrouted_experts_proto(bits: int) -> onnx.FunctionProto:
    nodes = [
        *_k_pad("fc1_codes", "k1_pad", 2),
        *_activations("X", "X_q", "k1_pad", 2),  # [T, K1_pad]
        *_dequantized("fc1_codes", "fc1_scales", bits, "W1", 1),  # [E, K1_pad, 2 I']
        _ints("gate_up_shape", [0, 0, -1, 2, 16]),
        node("Reshape", ["W1", "gate_up_shape"], ["W1_pairs"]),  # [E, K1_pad, I'/16, 2, 16]
        node("Constant", [], ["zero"], value_int=0),
        node("Constant", [], ["one"], value_int=1),
        node("Gather", ["W1_pairs", "zero"], ["gate_g"], axis=3),
        node("Gather", ["W1_pairs", "one"], ["up_g"], axis=3),
        _ints("e_k_i", [0, 0, -1]),
        node("Reshape", ["gate_g", "e_k_i"], ["gate"]),  # [E, K1_pad, I']
        node("Reshape", ["up_g", "e_k_i"], ["up"]),
        node("MatMul", ["X_q", "gate"], ["g"]),  # [T, K1_pad] @ [E, K1_pad, I'] -> [E, T, I']
        node("MatMul", ["X_q", "up"], ["u"]),
        node("Sigmoid", ["g"], ["sig"]),
        node("Mul", ["g", "sig"], ["silu"]),
        node("Mul", ["silu", "u"], ["act"]),  # [E, T, I']
        *_k_pad("fc2_codes", "k2_pad", 2),
        *_activations("act", "act_q", "k2_pad", 3),  # [E, T, K2_pad]
        *_dequantized("fc2_codes", "fc2_scales", bits, "W2", 1),  # [E, K2_pad, d']
        node("MatMul", ["act_q", "W2"], ["y_e"]),  # [E, T, d']
        node("Transpose", ["dispatch"], ["dispatch_e"], perm=[1, 0]),  # [T, E] -> [E, T]
        _ints("last", [-1]),
        node("Unsqueeze", ["dispatch_e", "last"], ["w"]),
        node("Mul", ["y_e", "w"], ["weighted"]),
        _ints("experts_axis", [0]),
        node("ReduceSum", ["weighted", "experts_axis"], ["y_padded"], keepdims=0),  # [T, d']
        node("Shape", ["X"], ["d"], start=1),
        _ints("start", [0]),
        _ints("columns", [1]),
        node("Slice", ["y_padded", "start", "d", "columns"], ["Y"]),  # [T, d]
    ]
    return helper.make_function(
        kernels.DOMAIN, kernels.QROUTED_EXPERTS[bits],
        ["X", "dispatch", "fc1_codes", "fc1_scales", "fc2_codes", "fc2_scales"], ["Y"], nodes,
        opset_imports=[helper.make_opsetid("", OPSET)], attributes=["block_size"], attribute_protos=_level_attributes(),
        doc_string=f"Y = sum_e dispatch[:, e] · down_e(silu(gate_e X) · up_e X) over int{bits} experts in mla-deploy's "
                   "quantized layout (export.layouts.routed_experts_layout). The kernel library runs only each "
                   "expert's own tokens; this body runs every expert on every token.")


@functools.cache
def _qgather_proto(bits: int) -> onnx.FunctionProto:
    if bits == 4:  # a piece's low nibbles are quad 2p, its high nibbles quad 2p + 1
        unpack = [
            node("Constant", [], ["sixteenth"], value_float=1 / 16),
            node("Constant", [], ["sixteen_f"], value_float=16.0),
            node("Mul", ["lane_f", "sixteenth"], ["high_f"]),
            node("Floor", ["high_f"], ["high"]),
            node("Mul", ["high", "sixteen_f"], ["high16"]),
            node("Sub", ["lane_f", "high16"], ["low"]),
            node("Concat", ["low", "high"], ["u"], axis=-1),  # [T, KB, B/8, 8]: k = 8 p + 4 h + t
        ]
    else:
        unpack = [node("Identity", ["lane_f"], ["u"])]
    nodes = [
        _ints("flat", [-1]),
        node("Reshape", ["ids", "flat"], ["ids_flat"]),  # [T]
        *_attribute("n", "N"),
        node("Constant", [], ["zero_id"], value_int=0),
        node("Less", ["ids_flat", "zero_id"], ["negative"]),
        node("Add", ["ids_flat", "n"], ["wrapped"]),
        node("Where", ["negative", "wrapped", "ids_flat"], ["id"]),  # negative ids count from the end, as Gather's
        node("Constant", [], ["sixteen"], value_int=16),
        node("Div", ["id", "sixteen"], ["group"]),
        node("Mod", ["id", "sixteen"], ["lane"]),
        _ints("lane_axis", [1]),
        node("Unsqueeze", ["lane", "lane_axis"], ["lane_index"]),  # [T, 1]
        node("Gather", ["codes", "group"], ["runs"], axis=0),  # [T, KB, 2·B·bits]
        _ints("piece_shape", [0, 0, -1, 16, 4]),
        node("Reshape", ["runs", "piece_shape"], ["pieces"]),  # [T, KB, P, 16 lanes, 4]: P 64-byte pieces per run
        node("Transpose", ["pieces"], ["by_lane"], perm=[0, 3, 1, 2, 4]),  # [T, 16, KB, P, 4]
        node("GatherND", ["by_lane", "lane_index"], ["lane_bytes"], batch_dims=1),  # [T, KB, P, 4]
        node("Cast", ["lane_bytes"], ["lane_f"], to=TensorProto.FLOAT),
        *unpack,
        _ints("block_shape", [0, 0, -1]),
        node("Reshape", ["u", "block_shape"], ["u_blocks"]),  # [T, KB, B]
        node("Constant", [], ["zero_point"], value_float=float(2 ** (bits - 1))),
        node("Sub", ["u_blocks", "zero_point"], ["q"]),
        node("Gather", ["scales", "group"], ["run_scales"], axis=0),  # [T, KB, 16]
        node("Transpose", ["run_scales"], ["scales_by_lane"], perm=[0, 2, 1]),  # [T, 16, KB]
        node("GatherND", ["scales_by_lane", "lane_index"], ["lane_scales"], batch_dims=1),  # [T, KB]
        node("Cast", ["lane_scales"], ["lane_scales_f"], to=TensorProto.FLOAT),
        _ints("scale_axis", [2]),
        node("Unsqueeze", ["lane_scales_f", "scale_axis"], ["block_scales"]),  # [T, KB, 1]
        node("Mul", ["q", "block_scales"], ["values_blocks"]),
        _ints("row_shape", [0, -1]),
        node("Reshape", ["values_blocks", "row_shape"], ["values"]),  # [T, KB·B]
        *_attribute("k", "K"),
        _ints("zero", [0]),
        _ints("one", [1]),
        node("Slice", ["values", "zero", "k", "one"], ["rows_k"]),  # [T, K]
        node("Shape", ["ids"], ["id_shape"]),
        node("Concat", ["id_shape", "k"], ["out_shape"], axis=0),
        node("Reshape", ["rows_k", "out_shape"], ["out"]),
    ]
    return helper.make_function(
        kernels.DOMAIN, kernels.QGATHER[bits], ["ids", "codes", "scales"], ["out"], nodes,
        opset_imports=[helper.make_opsetid("", OPSET)], attributes=["K", "N", "block_size"],
        doc_string=f"out[..., :] = W[:, ids[...]] dequantized, for an int{bits} W [K, N] in mla-deploy's quantized "
                   "layout: a tied head's embedding rows, or a separate embedding table stored as its transpose.")


def qmatmul_function(bits: int) -> ir.Function:
    """The body of mla_deploy.QMatMul4 / QMatMul8: what onnxruntime runs where the kernel library is not registered."""
    return ir.serde.deserialize_function(_qmatmul_proto(bits))


def qrouted_experts_function(bits: int) -> ir.Function:
    """The body of mla_deploy.QRoutedExperts4 / QRoutedExperts8."""
    return ir.serde.deserialize_function(_qrouted_experts_proto(bits))


def qgather_function(bits: int) -> ir.Function:
    """The body of mla_deploy.QGather4 / QGather8."""
    return ir.serde.deserialize_function(_qgather_proto(bits))
