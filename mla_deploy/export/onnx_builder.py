"""A small ONNX graph builder: `g.MatMul(a, b)` appends a node and returns its output name.

Weights are registered by name (`g.weight`) and kept as numpy arrays until the exporter writes
them once, to a data file both graphs share. Subgraphs (If branches) are builders too; they see
every name of the enclosing graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 24
IR_VERSION = 11  # what onnxruntime 1.31 reads for opset 24 (it refuses IR 14)

_DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "int64": TensorProto.INT64, "bool": TensorProto.BOOL}


class GraphBuilder:
    def __init__(self, name: str, weights: dict[str, np.ndarray] | None = None):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.constants: list[onnx.TensorProto] = []
        self.weights = {} if weights is None else weights  # shared with subgraphs: one store per model
        self._count = 0

    # ---- names ----
    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.name}/{hint}_{self._count}"

    # ---- graph interface ----
    def input(self, name: str, dtype: str, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, _DTYPES[dtype], list(shape)))
        return name

    def output(self, value: str, name: str, dtype: str, shape) -> None:
        if value != name:
            self.nodes.append(helper.make_node("Identity", [value], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, _DTYPES[dtype], list(shape)))

    def weight(self, name: str, array: np.ndarray) -> str:
        """A named initializer. The same name must always mean the same array."""
        if name in self.weights:
            assert self.weights[name].shape == array.shape, name
        else:
            self.weights[name] = np.ascontiguousarray(array)
        return name

    def const(self, value, dtype=np.int64) -> str:
        name = self.fresh("const")
        self.constants.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", out_names=None, **attrs):
        """Append a node; `out_names` gives its outputs fixed names (a graph output written directly, no Identity)."""
        names = list(out_names) if out_names else [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=names[0], domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)

    # ---- subgraphs ----
    def branch(self, name: str) -> "GraphBuilder":
        sub = GraphBuilder(f"{self.name}/{name}", self.weights)
        sub._count = 0
        return sub

    def to_graph(self) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializer=self.constants)

    def to_model(self, metadata: dict[str, str]) -> onnx.ModelProto:
        """The model with weights still outside it (the exporter adds them as external data)."""
        model = helper.make_model(self.to_graph(), opset_imports=[helper.make_opsetid("", OPSET)],
                                  ir_version=IR_VERSION, producer_name="mla-deploy",
                                  producer_version=metadata.get("mla_deploy_version", ""))
        helper.set_model_props(model, metadata)
        return model
