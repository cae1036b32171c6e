"""Side-by-side benchmarks: ONNX absorbed (fused, factored), a decompressed-K/V ONNX baseline, the torch
source (naive, absorbed) and transformers, on one checkpoint, in one process run."""

from .run import BenchConfig, run_bench

__all__ = ["BenchConfig", "run_bench"]
