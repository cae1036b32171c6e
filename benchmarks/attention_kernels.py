"""The decode attention core alone, one op per model, alternating in one process: mla_deploy.LatentAttentionQ8 over an
int8 latent cache at each instruction-set level this CPU has (MLA_DEPLOY_ISA), mla_deploy.LatentAttention over the
same cache dequantized to float32, and onnxruntime's ops over that float32 cache (the long-cache form: the cache as
MatMul's A operand, what `--decode-attention ops` runs at DeepSeek's lengths). DeepSeek's widths (d_c 512, d_r 64),
every slot seen; median and fastest of --repeats calls after one warm-up, each op in turn. With --tokens T > 1 the
chunk ops instead (LatentAttentionChunkQ8, LatentAttentionChunk: T query tokens a row, as a verification pass's, each
seeing the slots up to its own at the end of the context), against their function body, onnxruntime's one MatMul of
a row's T·h queries.

    .venv/bin/python benchmarks/attention_kernels.py [--heads 16] [--rows 1] [--tokens 1] [--contexts 4096,16384]
        [--threads 1] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from kernel_levels import LEVELS, cpu_level  # noqa: E402
from mla_deploy import kernels  # noqa: E402
from mla_deploy.export.attention import latent_attention_function, latent_attention_op  # noqa: E402
from mla_deploy.export.opset import OPSET  # noqa: E402
from mla_deploy.io_spec import CacheFormat  # noqa: E402


def one_op(cache: CacheFormat, width: int, chunk: bool) -> bytes:
    names = ["q_latent", "q_rope", "latent", *(["latent_scale"] if cache.scaled else []), "rope", "bias"]
    types = {"latent": TensorProto.INT8 if cache.scaled else TensorProto.FLOAT}
    graph = helper.make_graph(
        [helper.make_node(latent_attention_op(cache, True, chunk), names, ["out"], domain=kernels.DOMAIN)], "one_op",
        [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None) for n in names],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    opsets = [
        helper.make_opsetid("", OPSET),
        helper.make_opsetid(kernels.DOMAIN, 1),
        helper.make_opsetid("com.microsoft", 1),
    ]
    function = latent_attention_function(cache, True, width, chunk)
    return helper.make_model(graph, opset_imports=opsets, ir_version=11,
                             functions=[ir.serde.serialize_function(function)]).SerializeToString()


def session(cache: CacheFormat, width: int, threads: int, level: str | None, chunk: bool) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if level is not None:
        so.register_custom_ops_library(str(kernels.library()))
        os.environ["MLA_DEPLOY_ISA"] = level
    try:
        return ort.InferenceSession(one_op(cache, width, chunk), so, providers=["CPUExecutionProvider"])
    finally:
        os.environ.pop("MLA_DEPLOY_ISA", None)


def feeds(rows: int, tokens: int, heads: int, ctx: int, rng) -> tuple[dict, dict]:
    """The int8 op's inputs (codes of standard normal entries and their scales) and the float32 ops' (the same
    cache dequantized); queries of the scaled magnitude DeepSeek's run at; with tokens > 1 a chunk's [rows, T, h, ·]
    queries, token t seeing the slots up to ctx - T + t."""
    shape = (rows, heads) if tokens == 1 else (rows, tokens, heads)
    bias = np.zeros((rows, 1, tokens, ctx), np.float32)
    for t in range(tokens):
        bias[:, :, t, ctx - tokens + t + 1 :] = np.finfo(np.float32).min
    q = {
        "q_latent": (rng.standard_normal((*shape, 512)) * 0.05).astype(np.float32),
        "q_rope": (rng.standard_normal((*shape, 64)) * 0.05).astype(np.float32),
        "rope": rng.standard_normal((rows, ctx, 64), dtype=np.float32),
        "bias": bias,
    }
    latent = rng.standard_normal((rows, ctx, 512), dtype=np.float32)
    scale = np.abs(latent).max(-1, keepdims=True) / np.float32(127)
    codes = np.clip(np.rint(latent / scale), -127, 127).astype(np.int8)
    return {**q, "latent": codes, "latent_scale": scale}, {**q, "latent": codes * scale}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=1, help="query tokens a row (above 1: the chunk ops)")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    int8, f32 = CacheFormat("int8", "float32"), CacheFormat("float32", "float32")
    levels = LEVELS[1 : LEVELS.index(cpu_level()) + 1]  # the SIMD levels this CPU has (plain C: a reference path)
    chunk = args.tokens > 1
    name = "LatentAttentionChunk" if chunk else "LatentAttention"
    ops = {f"{name}Q8, {level}": (session(int8, 512, args.threads, level, chunk), True) for level in levels}
    ops[f"{name}, float32 cache"] = (session(f32, 512, args.threads, cpu_level(), chunk), False)
    ops["onnxruntime ops, float32 cache"] = (session(f32, 512, args.threads, None, chunk), False)
    print(f"{args.rows} row(s) x {args.tokens} token(s) x {args.heads} heads, d_c 512 + d_r 64, "
          f"{args.threads} thread(s), "
          f"{time.strftime('%Y-%m-%d')}, load average {os.getloadavg()[0]:.1f}")
    for ctx in (int(c) for c in args.contexts.split(",")):
        quantized, widened = feeds(args.rows, args.tokens, args.heads, ctx, np.random.default_rng(ctx))
        times = {name: [] for name in ops}
        for _ in range(args.repeats + 1):
            for name, (s, scaled) in ops.items():
                t0 = time.perf_counter()
                s.run(None, quantized if scaled else widened)
                times[name].append((time.perf_counter() - t0) * 1e3)
        for name, t in times.items():
            print(
                f"  ctx {ctx:>6}  {name:<34} median {statistics.median(t[1:]):8.2f} ms   fastest {min(t[1:]):8.2f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
