"""What one onnxruntime node costs beside the work it does: a chain of N `Add` nodes over one row of 2,048 floats
(a decode step's hidden state), graph optimizations off so that no node is fused away, 2 intra-op threads, median
of 200 runs; against a one-node graph.

    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/node_overhead.py [--nodes 1434]

1,434 is the full-size DeepSeek-V2-Lite int4 decode graph's node count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def chain(nodes: int, width: int) -> bytes:
    ops, prev = [], "x"
    for i in range(nodes):
        ops.append(helper.make_node("Add", [prev, "b"], [f"t{i}"]))
        prev = f"t{i}"
    graph = helper.make_graph(ops, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, width])],
                              [numpy_helper.from_array(np.ones((1, width), np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10  # what onnxruntime 1.31 reads
    onnx.checker.check_model(model)
    return model.SerializeToString()


def median_ms(nodes: int, width: int, runs: int) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(chain(nodes, width), options, providers=["CPUExecutionProvider"])
    feed = {"x": np.ones((1, width), np.float32)}
    for _ in range(20):
        session.run(None, feed)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1434)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    one, many = median_ms(1, args.width, args.runs), median_ms(args.nodes, args.width, args.runs)
    print(f"1 node: {one:.3f} ms; {args.nodes} nodes: {many:.3f} ms; "
          f"{(many - one) / (args.nodes - 1) * 1e3:.2f} us a node")


if __name__ == "__main__":
    main()
