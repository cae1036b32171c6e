"""The one compiled piece: mla_deploy/kernels' onnxruntime custom-op library (half-precision MatMul), built at
install time from the C sources there. Optional: where it does not build (no C compiler, not x86-64), the install
goes on and the graphs run the op's pure-ONNX function body instead (mla_deploy.kernels)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "mla_deploy.kernels._half_matmul", sources=["mla_deploy/kernels/half_matmul.c"],
    depends=["mla_deploy/kernels/ort_abi.h"], extra_compile_args=["-O3", "-fvisibility=hidden"], optional=True,
)])
