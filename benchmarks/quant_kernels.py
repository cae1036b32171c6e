"""mla-deploy's quantized kernels against onnxruntime's own, side by side on DeepSeek-V2-Lite's shapes.

    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/quant_kernels.py [--bits 4] [--block 32] [--threads 2]
        [--rows 1,8,512] [--cases q,kv_a,o,mlp_gate_up,mlp_down,moe,head] [--json out.json]

Each case is an ONNX model whose weights sit in an external data file, as an export writes them:
mla_deploy.QMatMul4/8 against com.microsoft MatMulNBits (accuracy_level 4 on both sides, the same bits and block,
MatMulNBits' scales the same float16-rounded values held as float32), and mla_deploy.QRoutedExperts4/8 against
com.microsoft QMoE for one MoE layer (64 experts, 6 chosen per token). Timings alternate the two models run by run
(median of --repeats), so machine noise lands on both. At 1 and 8 rows the weights come from memory, as in a decode
step whose layers take turns: a linear case runs as a chain of distinct copies of its weight (192 MB or more in all,
six times the L3; the time per copy is reported; the copies' bytes differ, as onnxruntime shares identical
initializers), the MoE layer after a 64 MiB buffer has been read; GB/s (weight
bytes read per second, codes and scales) is set against the memory bandwidth probed in the same run (onnxruntime's
float32 MatMul streaming 512 MiB at batch 1). Anonymous memory: each one-op model alone in a child process,
smaps_rollup's Anonymous after loading and one run minus before (what a session copies beyond the mapped file).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from mla_deploy import kernels
from mla_deploy.bench.bandwidth import matmul_read_gbs
from mla_deploy.export import layouts
from mla_deploy.export.absorb import gate_up_interleaved
from mla_deploy.export.quantize import quantize

# DeepSeek-V2-Lite: hidden 2048, 16 heads (q 192 = 128 nope + 64 rope, v 128), kv_lora 512, dense MLP 10944 (layer 0),
# 64 routed experts of 1408 (6 chosen), vocabulary 102400
LINEAR = {"q": (2048, 3072), "kv_a": (2048, 576), "o": (2048, 2048), "mlp_gate_up": (2048, 2 * 10944),
          "mlp_down": (10944, 2048), "head": (2048, 102400)}
MOE = dict(experts=64, chosen=6, d=2048, inter=1408)
FLUSH = np.ones(64 << 18, np.float32)  # 64 MiB, twice the L3
STREAM_BYTES = 192e6  # weights a decode-like chain reads per run

CHILD = """
import sys, numpy as np, onnxruntime as ort
from mla_deploy import kernels
from mla_deploy.runtime.memory import resident_memory
before = resident_memory().anonymous
so = ort.SessionOptions(); so.intra_op_num_threads = 2; so.log_severity_level = 3
so.register_custom_ops_library(str(kernels.library()))
s = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
feeds = {
    i.name: np.eye(1, i.shape[1], dtype=np.float32) if i.name == "dispatch" else np.zeros([1] + i.shape[1:], np.float32)
    for i in s.get_inputs()
}
s.run(None, feeds)
print(resident_memory().anonymous - before)
"""


def save(model: onnx.ModelProto, path: Path) -> str:
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.stem + ".bin", size_threshold=0)
    return str(path)


def onnx_model(nodes, inputs, initializers, opsets, outputs=("Y",)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "ops",
        inputs,
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21)] + [helper.make_opsetid(d, 1) for d in opsets], ir_version=10
    )


def quantized_weight(k: int, n: int, bits: int, block: int, rng):
    """A random W [k, n] quantized with float16 scales, and its kernel layout (codes, scales)."""
    w = np.empty((k, n), np.float32)
    for start in range(0, n, 4096):  # in slices: the head is 840 MB of float32
        w[:, start:start + 4096] = rng.standard_normal((k, min(4096, n - start)), np.float32) * 0.02
    qw = quantize(w, bits, block, scale_dtype="float16")
    return (qw, *layouts.qmatmul_layout(qw))


def linear_models(weight, out: Path, copies: int) -> tuple[str, str, int, int]:
    """(ours, MatMulNBits) model files of `copies` independent ops on distinct copies of one quantized weight (each
    reading A), and the bytes one op reads per call (codes and scales)."""
    qw, codes, scales = weight
    k, n, bits, block = qw.k, qw.n, qw.bits, qw.block
    a = [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])]
    ours_w, theirs_w, ours_ops, theirs_ops = {}, {}, [], []
    for i in range(copies):  # copies differ (rolled by i columns): onnxruntime shares identical initializers
        ours_w |= {f"codes{i}": np.roll(codes, i, axis=0), f"scales{i}": np.roll(scales, i, axis=0)}
        theirs_w |= {
            f"B{i}": np.roll(qw.codes, i, axis=0),
            f"scales{i}": np.roll(qw.scales, i, axis=0).astype(np.float32),
        }
        ours_ops.append(helper.make_node(kernels.QMATMUL[bits], ["A", f"codes{i}", f"scales{i}"], [f"Y{i}"],
                                         domain=kernels.DOMAIN, K=k, N=n, block_size=block, accuracy_level=4))
        theirs_ops.append(
            helper.make_node(
                "MatMulNBits",
                ["A", f"B{i}", f"scales{i}"],
                [f"Y{i}"],
                domain="com.microsoft",
                K=k,
                N=n,
                bits=bits,
                block_size=block,
                accuracy_level=4,
            )
        )
    outputs = [f"Y{i}" for i in range(copies)]
    ours = onnx_model(ours_ops, a, ours_w, [kernels.DOMAIN], outputs)
    theirs = onnx_model(theirs_ops, a, theirs_w, ["com.microsoft"], outputs)
    return (save(ours, out / f"ours_{k}x{n}x{copies}.onnx"), save(theirs, out / f"theirs_{k}x{n}x{copies}.onnx"),
            codes.nbytes + scales.nbytes, qw.codes.nbytes + 4 * qw.scales.size)


def moe_models(bits: int, block: int, rng, out: Path) -> tuple[str, str, int, int]:
    """QRoutedExperts and QMoE over the same experts, and the bytes of one expert's weights (codes and scales)."""
    e, d, inter = MOE["experts"], MOE["d"], MOE["inter"]
    gates, ups, downs, qmoe1, qmoe2 = [], [], [], [], []
    for _ in range(e):
        g, u = (rng.standard_normal((inter, d), np.float32) * 0.02 for _ in range(2))  # HF [I, d]
        down = rng.standard_normal((d, inter), np.float32) * 0.02  # HF [d, I]
        gates.append(quantize(g.T, bits, block, scale_dtype="float16"))
        ups.append(quantize(u.T, bits, block, scale_dtype="float16"))
        downs.append(quantize(down.T, bits, block, scale_dtype="float16"))
        qmoe1.append(quantize(gate_up_interleaved(g, u), bits, block, scale_dtype="float16"))
        qmoe2.append(downs[-1])
    ours_w = layouts.routed_experts_layout(gates, ups, downs)
    x = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", d]),
         helper.make_tensor_value_info("dispatch", TensorProto.FLOAT, ["T", e])]
    ours = onnx_model([helper.make_node(kernels.QROUTED_EXPERTS[bits], ["X", "dispatch", *ours_w], ["Y"],
                                        domain=kernels.DOMAIN, block_size=block, accuracy_level=4)], x, ours_w,
                      [kernels.DOMAIN])
    chosen = helper.make_node("Cast", ["nonzero"], ["chosen"], to=TensorProto.FLOAT)
    nonzero = helper.make_node("Greater", ["dispatch", "zero"], ["nonzero"])
    theirs_w = {"fc1": np.stack([q.codes.reshape(q.n, -1) for q in qmoe1]),
                "fc1_scales": np.stack([q.scales.astype(np.float32) for q in qmoe1]),
                "fc2": np.stack([q.codes.reshape(q.n, -1) for q in qmoe2]),
                "fc2_scales": np.stack([q.scales.astype(np.float32) for q in qmoe2]), "zero": np.zeros((), np.float32)}
    qmoe = helper.make_node("QMoE", ["X", "chosen", "fc1", "fc1_scales", "", "fc2", "fc2_scales", "", "", "", "", "",
                                     "", "", "dispatch"], ["Y"], domain="com.microsoft", k=MOE["chosen"],
                            activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                            normalize_routing_weights=0, expert_weight_bits=bits, block_size=block, accuracy_level=4)
    theirs = onnx_model([nonzero, chosen, qmoe], x, theirs_w, ["com.microsoft"])
    per_expert = sum(v.nbytes for v in ours_w.values()) // e
    return save(ours, out / "ours_moe.onnx"), save(theirs, out / "theirs_moe.onnx"), per_expert, per_expert


def session(path: str, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def feeds(case: str, rows: int, k: int, rng) -> dict[str, np.ndarray]:
    x = rng.standard_normal((rows, k), np.float32)
    if case != "moe":
        return {"A": x}
    dispatch = np.zeros((rows, MOE["experts"]), np.float32)
    for t in range(rows):
        dispatch[t, rng.choice(MOE["experts"], MOE["chosen"], replace=False)] = 1.0 / MOE["chosen"]
    return {"X": x, "dispatch": dispatch}


def alternate(ours, theirs, inputs, repeats: int, cold: bool) -> tuple[float, float]:
    """Median seconds of each, run A, B, A, B, ... (the weights evicted from the caches before each run if `cold`)."""
    times = ([], [])
    for s in (ours, theirs):
        s.run(None, inputs)
    for _ in range(repeats):
        for s, t in zip((ours, theirs), times):
            if cold:
                FLUSH.sum()
            start = time.perf_counter()
            s.run(None, inputs)
            t.append(time.perf_counter() - start)
    return float(np.median(times[0])), float(np.median(times[1]))


def anonymous_bytes(path: str) -> int:
    done = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


_models: dict[tuple, tuple] = {}
_weights: dict[str, tuple] = {}


def models(case: str, copies: int, args, rng, tmp: Path) -> tuple:
    """(ours path, theirs path, ours bytes, theirs bytes, K) of `case` with `copies` ops, made once."""
    if (case, copies) not in _models:
        if case == "moe":
            _models[case, copies] = (*moe_models(args.bits, args.block, rng, tmp), MOE["d"])
        else:
            if case not in _weights:
                _weights.clear()  # one case's weight at a time: the head's is hundreds of MB
                _weights[case] = quantized_weight(*LINEAR[case], args.bits, args.block, rng)
            _models[case, copies] = (*linear_models(_weights[case], tmp, copies), LINEAR[case][0])
    return _models[case, copies]


def run_case(case: str, m: int, args, rng, tmp: Path) -> dict:
    single = models(case, 1, args, rng, tmp)
    if (case, "anonymous") not in _anonymous:
        _anonymous[case, "anonymous"] = anonymous_bytes(single[0]), anonymous_bytes(single[1])
    anon = _anonymous[case, "anonymous"]
    copies = 1 if case == "moe" or m > 8 else max(1, int(np.ceil(STREAM_BYTES / single[2])))
    ours_path, theirs_path, ours_bytes, theirs_bytes, k = models(case, copies, args, rng, tmp)
    ours, theirs = session(ours_path, args.threads), session(theirs_path, args.threads)
    inputs = feeds(case, m, k, rng)
    repeats = args.repeats if m < 512 else max(3, args.repeats // 2)
    t_ours, t_theirs = (t / copies for t in alternate(ours, theirs, inputs, repeats, case == "moe" and m <= 8))
    if case == "moe":  # the experts some token chose are read, each once
        read = len(np.nonzero(inputs["dispatch"].any(0))[0])
        flops = 2 * 3 * m * MOE["chosen"] * MOE["d"] * MOE["inter"]
        bytes_ours, bytes_theirs, n = read * ours_bytes, read * theirs_bytes, MOE["d"]
    else:
        n = LINEAR[case][1]
        flops, bytes_ours, bytes_theirs = 2 * m * k * n, ours_bytes, theirs_bytes
    row = {
        "case": case,
        "k": k,
        "n": n,
        "rows": m,
        "copies": copies,
        "ours_ms": t_ours * 1e3,
        "theirs_ms": t_theirs * 1e3,
        "ours_gflops": flops / t_ours / 1e9,
        "theirs_gflops": flops / t_theirs / 1e9,
        "ours_gbs": bytes_ours / t_ours / 1e9,
        "theirs_gbs": bytes_theirs / t_theirs / 1e9,
        "ours_anonymous_mb": anon[0] / 1e6,
        "theirs_anonymous_mb": anon[1] / 1e6,
        "weights_mb": ours_bytes * (MOE["experts"] if case == "moe" else 1) / 1e6,
    }
    print(f"{case:12s} {f'{k}x{n}':>13s} {m:4d} | {row['ours_ms']:9.3f} {row['ours_gflops']:8.1f} "
          f"{row['ours_gbs']:6.1f} | {row['theirs_ms']:9.3f} {row['theirs_gflops']:8.1f} {row['theirs_gbs']:6.1f} | "
          f"{t_theirs / t_ours:6.2f}x | {row['weights_mb']:8.1f} {anon[0] / 1e6:7.1f} {anon[1] / 1e6:7.1f}", flush=True)
    return row


_anonymous: dict[tuple, tuple] = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8,512")
    parser.add_argument("--cases", default=",".join([*LINEAR, "moe"]))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    unknown = [c for c in args.cases.split(",") if c not in (*LINEAR, "moe")]
    if unknown:
        parser.error(f"--cases {args.cases}: {', '.join(unknown)} unknown; the cases are {', '.join([*LINEAR, 'moe'])}")
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    bandwidth = matmul_read_gbs(args.threads)
    print(f"{platform.processor() or platform.machine()}, {args.threads} threads, int{args.bits} block {args.block}, "
          f"onnxruntime {ort.__version__}, probed bandwidth {bandwidth:.1f} GB/s", flush=True)
    print(
        f"{'case':12s} {'K x N':>13s} {'M':>4s} | {'ours ms':>9s} {'GFLOP/s':>8s} {'GB/s':>6s} | "
        f"{'ORT ms':>9s} {'GFLOP/s':>8s} {'GB/s':>6s} | {'speedup':>7s} | {'weights':>8s} {'anon MB':>7s} {'ORT':>7s}",
        flush=True,
    )
    results = {"bandwidth_gbs": bandwidth, "bits": args.bits, "block": args.block, "threads": args.threads, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            for m in rows:
                results["cases"].append(run_case(case, m, args, rng, Path(tmp)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
