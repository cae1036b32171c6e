"""mla_deploy.MatMulF16 / MatMulBF16 on each instruction-set path this CPU has, beside onnxruntime's float32 MatMul of
the same shape, interleaved in one run: GFLOP/s (2 M K N per product).

    .venv/bin/python benchmarks/half_matmul.py [--threads 1,2] [--rounds 3] [--dtype float16] [--shapes M:K:N,...]

Default shapes: a 512-token prefill of DeepSeek-V2-Lite's layers (q_proj, kv_a, kv_b, o_proj, the dense MLP's gate
and up together and its down, one routed expert's gate and up at 48 tokens), a batch of 8 and one row (decode).
Each level runs in its own session (MLA_DEPLOY_ISA, read as onnxruntime creates the kernel), the levels and the
float32 MatMul alternating within each round; a figure is the best of its rounds (these machines are shared: the
best run is the one least disturbed). Wrap it in `flock /tmp/mla-cpu.lock`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_deploy import kernels  # noqa: E402
from mla_deploy.export.linear import half_matmul_function  # noqa: E402
from mla_deploy.export.opset import OPSET  # noqa: E402
from mla_deploy.safetensors_io import float32_to_bf16  # noqa: E402

SHAPES = (
    "512:2048:3072,512:2048:576,512:512:4096,512:2048:2048,512:2048:21888,512:10944:2048,"
    "48:2048:2816,8:2048:2048,1:2048:21888"
)
TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def levels() -> list[str]:
    """The MLA_DEPLOY_ISA levels with a SIMD path this CPU runs (tests/kernel_levels.py reads the same flags)."""
    flags = set()
    if Path("/proc/cpuinfo").exists():
        line = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "flags:")
        flags = set(line.split(":", 1)[1].split())
    found = []
    if {"avx2", "fma", "f16c"} <= flags:
        found.append("avx2")
        if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"} <= flags:
            found.append("avx512")
    return found


def half_model(k: int, n: int, dtype: str, rng) -> bytes:
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    bits = w.astype(np.float16) if dtype == "float16" else float32_to_bf16(w)
    strips = np.ascontiguousarray(kernels.column_strips(bits))
    graph = helper.make_graph(
        [helper.make_node(kernels.HALF_MATMUL[dtype], ["a", "b"], ["y"], domain=kernels.DOMAIN)], "one_op",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[helper.make_tensor("b", TYPES[dtype], strips.shape, strips.tobytes(), raw=True)])
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(kernels.DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=11,
                              functions=[ir.serde.serialize_function(half_matmul_function(dtype))])
    return model.SerializeToString()


def float32_model(k: int, n: int, rng) -> bytes:
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "one_op",
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(w, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=11).SerializeToString()


def session(model: bytes, threads: int, level: str | None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if level is not None:
        os.environ["MLA_DEPLOY_ISA"] = level
        so.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def seconds(sess: ort.InferenceSession, a: np.ndarray, budget: float = 0.3) -> float:
    """The fastest of at least 3 runs (and about `budget` seconds of them), after one warm-up."""
    sess.run(None, {"a": a})
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 3 or spent < budget:
        t0 = time.perf_counter()
        sess.run(None, {"a": a})
        t = time.perf_counter() - t0
        best, spent, runs = min(best, t), spent + t, runs + 1
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float16", choices=sorted(TYPES))
    ap.add_argument("--shapes", default=SHAPES, help="M:K:N,... (N a multiple of 64)")
    args = ap.parse_args()
    if kernels.library() is None:
        print("the kernel library is not built here (pip install -e . with a C compiler)", file=sys.stderr)
        return 1
    found = levels()
    print(f"{args.dtype} weights; levels {', '.join(found)}; best of {args.rounds} rounds; GFLOP/s = 2 M K N / s")
    print(
        "| M | K | N | threads | "
        + " | ".join(f"MatMul{'F16' if args.dtype == 'float16' else 'BF16'} {lv}" for lv in found)
        + " | float32 MatMul |"
    )
    print("|---|---|---|---|" + "---|" * (len(found) + 1))
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        m, k, n = (int(x) for x in shape.split(":"))
        a = rng.standard_normal((m, k)).astype(np.float32)
        half, single = half_model(k, n, args.dtype, rng), float32_model(k, n, rng)
        for threads in (int(t) for t in args.threads.split(",")):
            sessions = {lv: session(half, threads, lv) for lv in found}
            sessions["float32"] = session(single, threads, None)
            best = {name: float("inf") for name in sessions}
            for _ in range(args.rounds):
                for name, sess in sessions.items():
                    best[name] = min(best[name], seconds(sess, a))
            cells = [f"{2 * m * k * n / best[name] / 1e9:.1f}" for name in sessions]
            print(f"| {m} | {k} | {n} | {threads} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
