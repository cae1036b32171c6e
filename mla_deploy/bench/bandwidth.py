"""Memory bandwidth measured in the same run as the engines: the limit a batch-1 decode works against."""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def matmul_read_gbs(threads: int, mbytes: int = 512, repeats: int = 7, k: int = 4096) -> float:
    """GB/s at which onnxruntime's fp32 MatMul reads a weight at batch 1 (x [1, K] @ W [K, N]), best of `repeats`."""
    n = mbytes * 2**20 // (4 * k)
    w = np.full((k, n), 0.5, np.float32)  # written pages (real data), never the kernel's shared zero page
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "bw",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              initializer=[numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    session = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = np.ones((1, k), np.float32)
    session.run(None, {"x": x})
    best = min(_timed(lambda: session.run(None, {"x": x})) for _ in range(repeats))
    return w.nbytes / best / 1e9


def numpy_read_gbs(mbytes: int = 512, repeats: int = 5, threads: int = 1) -> float:
    """GB/s of numpy reductions over real data, one slice per thread (an independent second figure)."""
    import threading

    a = np.full(mbytes * 2**20 // 4, 0.5, np.float32)
    parts = np.array_split(a, threads)

    def read():
        workers = [threading.Thread(target=p.sum) for p in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    best = min(_timed(read) for _ in range(repeats))
    return a.nbytes / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
