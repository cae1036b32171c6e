"""One graph under construction (`Graph`): onnxscript's builder, the export's plan, and the weights by name from the
shared weights file; and the ONNX functions of mla-deploy's kernel ops, built from the same graph code.

The graph modules (export.norm, rope, linear, attention, moe, model) mirror `mla_deploy/modeling/` file for file.
Each is built over a `Graph` and reads its weights by HF name through `Tensors`; the weights it multiplies by are
the pure transforms of `export.absorb`, written once to the shared weights file by `Graph.weight`. Calling a module
(`module(op, x)`) emits its nodes with `op`, so the same module code serves the main graph, the `If` branches of the
experts and the kernel ops' function bodies (`kernel_function`).

Precision (export.plan): weights are stored in the plan's dtype, caches in its cache format, and the layers compute
in its compute dtype (float32 for every dtype on the CPU; a half weight goes through mla_deploy's MatMulF16 /
MatMulBF16, which multiply by it as stored: export.linear). RMSNorm statistics, rope, the attention core
(absorbed query, scores, softmax, probs @ latent, the per-head and fused absorbed matrices) and the router run in
float32 islands, entered with `Graph.to_float` and left with `Graph.to_compute`.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import numpy as np
import onnx_ir as ir
import onnxscript
from onnxscript import GraphBuilder

from .. import io_spec, kernels
from ..errors import ExportError
from . import layouts
from .opset import IR_VERSION, OPSET
from .plan import ExportPlan
from .quantize import QuantizedWeight, quantize
from .weights import WeightsFile

Tensors = Callable[[str], np.ndarray]  # HF tensor name -> float32 array
FLOAT, BOOL, INT8 = ir.DataType.FLOAT, ir.DataType.BOOL, ir.DataType.INT8
DATA_TYPES = {"int64": ir.DataType.INT64, "int8": INT8, "float32": FLOAT, "float16": ir.DataType.FLOAT16,
              "bfloat16": ir.DataType.BFLOAT16}


def cast(op, x: ir.Value, source: ir.DataType, to: ir.DataType) -> ir.Value:
    """x (of dtype `source`) as `to`: no node when they are the same."""
    return x if source == to else op.Cast(x, to=to)


def kernel_function(
    name: str,
    inputs: dict[str, ir.DataType],
    output: str,
    body: Callable[..., ir.Value],
    doc: str,
    opsets: dict[str, int] | None = None,
    attributes: dict[str, int | None] | None = None,
) -> ir.Function:
    """The ONNX body of mla-deploy's kernel op `name`: `body(op, *inputs)`, graph code shared with the graphs, run
    over a builder whose inputs are the function's (name -> element type: typed, the builder infers every value's
    type, as in a graph). Every graph that uses an op carries its body, which onnxruntime
    inlines and runs wherever the kernel library is not registered (no C compiler at install, a CPU without
    AVX2/FMA/F16C, RuntimeOptions(kernels=False), CUDA); the weight re-layouts and casts in a body depend only on
    initializers, so onnxruntime folds them once at load. `attributes`: the op's integer attributes (name -> default,
    None for one every node must set), which the body reads with `attribute`."""
    values = [ir.Value(name=n, type=ir.TensorType(dtype)) for n, dtype in inputs.items()]
    declared = [ir.Attr(n, ir.AttributeType.INT, default) for n, default in (attributes or {}).items()]
    function = onnxscript.build_function(body, values, domain=kernels.DOMAIN, name=name, attributes=declared,
                                         opset_imports={"": OPSET, **(opsets or {})})
    function.outputs[0].name = output
    function.doc_string = doc
    return function


def attribute(op, name: str) -> ir.Value:
    """Inside a kernel_function body: the calling node's integer attribute `name` as a [1] int64 tensor."""
    value = op.Constant(value_int=ir.RefAttr("value_int", name, ir.AttributeType.INT))
    value.dtype, value.shape = ir.DataType.INT64, ir.Shape([])
    return op.Reshape(value, [1])


class Graph:
    """One graph under construction: onnxscript's builder, the plan it is built from, and weights by name from the
    shared file."""

    def __init__(self, name: str, weights: WeightsFile, plan: ExportPlan):
        opsets = {"": OPSET, "com.microsoft": 1}  # FusedMatMul in decode attention; QMoE, MatMulNBits
        self.kind = name  # io_spec's graph kind (prefill, decode, ...)
        self.builder = GraphBuilder(ir.Graph([], [], nodes=[], opset_imports=opsets, name=name))
        self.op = self.builder.op
        self.weights = weights
        self.plan = plan
        self.compute_type, self.stored_type = DATA_TYPES[plan.compute], DATA_TYPES[plan.dtype]
        self.cache_type, self.rope_type = DATA_TYPES[plan.cache_dtype], DATA_TYPES[plan.rope_dtype]
        self._values: dict[str, ir.Value] = {}
        self.functions: dict[ir.OperatorIdentifier, ir.Function] = {}  # kernel ops' ONNX bodies (mla_deploy.kernels)

    def weight(self, name: str, make: Callable[[], np.ndarray], island: bool = False) -> ir.Value:
        """The weight `name` of this graph in the compute dtype (or float32 for a float32 `island`'s weight); `make`
        runs only if no graph has written it yet. Stored in the export's dtype; where that is not the compute dtype
        (bfloat16 on the CPU) the graph casts it once (onnxruntime folds the cast at load)."""
        if island:
            return self.initializer(name, make, "float32")
        stored = self.initializer(name, make, self.plan.dtype)
        if self.plan.dtype == self.plan.compute:
            return stored
        if f"{name}:compute" not in self._values:
            self._values[f"{name}:compute"] = self.op.Cast(stored, to=self.compute_type)
        return self._values[f"{name}:compute"]

    def initializer(self, name: str, make: Callable[[], np.ndarray], dtype: str) -> ir.Value:
        """The tensor `name` as stored in `dtype` (a float weight; quantized codes stay uint8), written on first use."""
        if name not in self._values:
            tensor = self.weights.tensor(name, make, dtype)
            self._values[name] = self.builder.initializer(tensor, name=name, qualify=False)
        return self._values[name]

    def weight_view(self, name: str, of: str, shape: tuple[int, ...]) -> ir.Value:
        """The written weight `of` reshaped to `shape` as the initializer `name`: the same bytes in weights.bin."""
        if name not in self._values:
            self._values[name] = self.builder.initializer(self.weights.view(name, of, shape), name=name, qualify=False)
        return self._values[name]

    def quantized_weight(self, name: str, make: Callable[[], np.ndarray], bits: int, island: bool = False,
                         heads: bool = False) -> tuple[ir.Value, ir.Value, int, int]:
        """Codes and scales of the float weight `make()` [K, N], quantized once, in the plan's form; and K, N.
        `heads`: make() is one weight per head [h, K, N], each quantized alone and stacked (kernel form only).
        "kernel": the kernels' layout (export.layouts: codes [G, KB, 2·B·bits], float16 scales [G, KB, 16]);
        "onnxruntime": MatMulNBits' codes [N, KB, B·bits/8] and scales [N, KB] in the compute dtype, or float32 for a
        float32 `island`'s MatMulNBits."""
        made = {}

        def quantized() -> QuantizedWeight:
            if "q" not in made:
                made["q"] = self.quantize(name, make(), bits)
                self.weights.shapes[name] = (made["q"].k, made["q"].n)
            return made["q"]

        def stacked() -> tuple[np.ndarray, np.ndarray]:  # one weight per head: W [h, K, N], each quantized alone
            per_head = [self.quantize(name, w, bits) for w in make()]
            self.weights.shapes[name] = (per_head[0].k, per_head[0].n)
            parts = [layouts.qmatmul_layout(w) for w in per_head]
            return np.stack([c for c, _ in parts]), np.stack([s for _, s in parts])

        if self.plan.quantized_ops == "kernel":
            def layout(part: int) -> np.ndarray:
                if "layout" not in made:
                    if heads:
                        made["layout"] = stacked()
                    else:
                        made["layout"] = layouts.qmatmul_layout(quantized())
                        made.pop("q")  # the layout holds every code: the quantized weight can go
                return made["layout"][part]

            codes = self.initializer(f"{name}.codes", lambda: layout(0), "uint8")
            scales = self.initializer(f"{name}.scales", lambda: layout(1), "float16")
        else:
            codes = self.initializer(f"{name}.codes", lambda: quantized().codes, "uint8")  # [N, k_blocks, B·bits/8]
            scales = self.initializer(f"{name}.scales", lambda: quantized().scales,
                                      "float32" if island else self.plan.compute)  # [N, k_blocks]
        return (codes, scales, *self.weights.shapes[name])

    def quantize(self, name: str, w_in_out: np.ndarray, bits: int) -> QuantizedWeight:
        """W [K, N] quantized as the plan says (bits, block, scale dtype); a block beyond float16 scales' range is
        refused naming the weight."""
        q = self.plan.quantization
        try:
            return quantize(w_in_out, bits, q.block, scale_dtype=q.scale_dtype)
        except ValueError as e:
            raise ExportError(
                f"{name}: {e}".replace(
                    "quantize with scale_dtype='float32'", "export with --quantized-ops onnxruntime (float32 scales)"
                )
            ) from None

    def to_float(self, op, x: ir.Value) -> ir.Value:
        """Into a float32 island from the compute dtype."""
        return cast(op, x, self.compute_type, FLOAT)

    def to_compute(self, op, x: ir.Value) -> ir.Value:
        """Out of a float32 island, back to the compute dtype."""
        return cast(op, x, FLOAT, self.compute_type)

    def kernel_op(self, op, name: str, function: Callable[[], ir.Function], *inputs: ir.Value,
                  **attributes: int) -> ir.Value:
        """A node of mla-deploy's kernel library (mla_deploy.kernels), its ONNX body (`function()`, built once per
        graph) carried by the model. Its output is float32, declared here: onnx's shape inference cannot type a body
        that uses com.microsoft ops."""
        if (kernels.DOMAIN, name, "") not in self.functions:
            self.functions[(kernels.DOMAIN, name, "")] = function()
        self.builder.graph.opset_imports[kernels.DOMAIN] = 1
        out = getattr(op, name)(*inputs, _domain=kernels.DOMAIN, **attributes)
        out.dtype = FLOAT
        return out

    def input(self, spec: io_spec.TensorSpec) -> ir.Value:
        return self.builder.input(spec.name, DATA_TYPES[spec.dtype], list(spec.shape))

    def output(self, value: ir.Value, spec: io_spec.TensorSpec) -> None:
        """`value` becomes the graph output `spec.name` itself (renamed, no Identity in between)."""
        self.builder.add_output(value, spec.name)
        value.dtype = DATA_TYPES[spec.dtype]
        value.shape = ir.Shape(list(spec.shape))

    @contextlib.contextmanager
    def scope(self, name: str):
        """Node names under `name` (layers.3.attn/...): readable profiles and graph viewers."""
        self.builder.push_module(name)
        try:
            yield
        finally:
            self.builder.pop_module()

    def model(self, metadata: dict[str, str]) -> ir.Model:
        return ir.Model(self.builder.graph, ir_version=IR_VERSION, producer_name="mla-deploy",
                        producer_version=metadata.get("mla_deploy_version", ""), metadata_props=dict(metadata),
                        functions=list(self.functions.values()))
