"""The one compiled piece: mla_deploy/kernels' onnxruntime custom-op library (MatMul by a float16 or bfloat16
weight as stored), built at install time from the C sources there. Optional: where it does not build (no C compiler, not x86-64), the install
goes on and the graphs run the op's pure-ONNX function body instead (mla_deploy.kernels)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "mla_deploy.kernels._half_matmul", sources=["mla_deploy/kernels/half_matmul.c", "mla_deploy/kernels/custom_ops.c"],
    depends=["mla_deploy/kernels/half_matmul.h", "mla_deploy/kernels/ort_abi.h"], extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-fvisibility=hidden"], optional=True,
)])
