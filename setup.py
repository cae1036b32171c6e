"""The one compiled piece: mla_deploy/kernels' onnxruntime custom-op library (MatMul by a float16 or bfloat16
weight as stored; a MoE layer's routed experts; MLA's decode attention over the latent cache), built at install time
from the C sources there. Optional: where it does not build (no C compiler, not x86-64), the install goes on and
the graphs run the ops' pure-ONNX function bodies instead (mla_deploy.kernels)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "mla_deploy.kernels._kernels",
    sources=[f"mla_deploy/kernels/{name}.c"
             for name in ("dispatch", "strip_matmul", "routed_experts", "latent_attention", "latent_attention_q8",
                          "qmatmul", "qexperts", "qgather", "custom_ops")],
    depends=[f"mla_deploy/kernels/{name}.h"
             for name in ("dispatch", "strip_matmul", "routed_experts", "latent_attention", "latent_attention_q8",
                          "widen", "ort_abi", "qmatmul", "qexperts", "qgather", "quant_simd")],
    extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden"], optional=True,
)])
