"""mla_deploy.kernels: the MatMul custom ops for float16 and bfloat16 weights (built at install time from C)
against numpy, with their ONNX function bodies as the fallback, their errors, and half exports run through them and
without them."""

import platform
import re
import shutil
import sysconfig

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from mla_deploy import io_spec, kernels
from mla_deploy.export import ExportOptions, export
from mla_deploy.export.linear import half_matmul_function
from mla_deploy.export.opset import OPSET
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from mla_deploy.runtime.feeds import prefill_feed
from mla_deploy.safetensors_io import bf16_to_float32, float32_to_bf16

import kernel_levels
from optimized_graph import optimized_op_types

BUILT = kernels.library() is not None
needs_library = pytest.mark.skipif(not BUILT, reason="the kernel library did not build on this machine (no compiler)")


def test_the_library_builds_on_x86_64_linux_with_a_compiler():
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if platform.machine() not in ("x86_64", "AMD64") or shutil.which(compiler) is None:
        pytest.skip(f"no {compiler} or not x86-64: the install skips the library and the graphs run its function body")
    assert BUILT, "setup.py should have built mla_deploy/kernels/_kernels*.so (pip install -e . shows why not)"


@pytest.mark.parametrize("cap", ["AVX2", "sse", "avx-512"])
def test_a_level_the_library_does_not_know_is_refused_not_ignored(cap, monkeypatch):
    """The library would run the CPU's own level for a name it does not know: a mistyped forced level would test
    another path than asked, unsaid."""
    from mla_deploy.errors import MLADeployError

    monkeypatch.setenv("MLA_DEPLOY_ISA", cap)
    with pytest.raises(MLADeployError, match=f"MLA_DEPLOY_ISA={cap}: expected one of scalar, avx2, avx512"):
        kernels.library()
    monkeypatch.setenv("MLA_DEPLOY_ISA", "avx2")
    assert (kernels.library() is not None) == BUILT


def test_column_strips_lays_w_out_as_the_kernel_reads_it():
    w = np.arange(5 * 192, dtype=np.float32).reshape(5, 192)
    b = kernels.column_strips(w)
    assert b.shape == (3, 5, 64)
    for s, k, j in [(0, 0, 0), (1, 4, 63), (2, 3, 17)]:
        assert b[s, k, j] == w[k, 64 * s + j]
    with pytest.raises(ValueError, match="N = 100 is not a multiple of 64"):
        kernels.column_strips(np.zeros((3, 100), np.float32))


HALF = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _half_bits(w: np.ndarray, dtype: str) -> np.ndarray:
    """W rounded to `dtype`, as numpy holds it: float16, or bfloat16's uint16 bit patterns."""
    return w.astype(np.float16) if dtype == "float16" else float32_to_bf16(w.astype(np.float32))


def _as_float64(bits: np.ndarray, dtype: str) -> np.ndarray:
    return (bits.astype(np.float32) if dtype == "float16" else bf16_to_float32(bits)).astype(np.float64)


def _one_op_model(k: int, n: int, dtype: str = "float16", weight: np.ndarray | None = None, a_rank: int = 2,
                  b_shape=None) -> bytes:
    """Y = mla_deploy.MatMul(B)F16(A, B) with its function body; B the initializer `weight` (W [k, n] as half bits,
    stored as strips), or else a graph input of `b_shape`."""
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [None] * (a_rank - 1) + [k])]
    initializers = []
    if weight is None:
        inputs.append(helper.make_tensor_value_info("b", HALF[dtype], b_shape))
    else:
        strips = np.ascontiguousarray(kernels.column_strips(weight))
        initializers.append(helper.make_tensor("b", HALF[dtype], strips.shape, strips.tobytes(), raw=True))
    graph = helper.make_graph(
        [helper.make_node(kernels.HALF_MATMUL[dtype], ["a", "b"], ["y"], domain=kernels.DOMAIN)], "one_op", inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=initializers)
    function = ir.serde.serialize_function(half_matmul_function(dtype))
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(kernels.DOMAIN, 1)],
        functions=[function],
        ir_version=11,
    )
    return model.SerializeToString()


def _session(model: bytes, library: bool, threads: int = 2) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library:
        so.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


# (rows, K, N): one row (decode), a few (batched decode: 2-12 rows, groups balanced), many (prefill: groups of up to 6
# with a ragged last one, several blocks of groups per strip where strips are few); K below, at and across the kernel's
# 256-row passes (a short last pass); 1-4 strips
SHAPES = [(1, 40, 64), (1, 300, 192), (2, 17, 128), (3, 513, 64), (7, 256, 64), (8, 513, 128), (12, 64, 256),
          (13, 300, 128), (40, 520, 256), (64, 33, 64), (64, 700, 192), (512, 300, 128), (512, 1000, 64)]


def _check_half_matmul(rows, k, n, dtype, library):
    """Each output within float32 accumulation error of the exact product (K x 2^-24 x sum |a||w|, the textbook bound
    for a K-term float32 dot product): the half weight is widened exactly, as the function body's Cast does."""
    rng = np.random.default_rng(rows * 1000 + k + n)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    w = _half_bits((rng.standard_normal((k, n)) * 0.1).astype(np.float32), dtype)
    y = _session(_one_op_model(k, n, dtype, w), library).run(None, {"a": a})[0]
    assert y.dtype == np.float32 and y.shape == (rows, n)
    exact = a.astype(np.float64) @ _as_float64(w, dtype)
    bound = k * 2.0**-24 * (np.abs(a.astype(np.float64)) @ np.abs(_as_float64(w, dtype)))
    assert np.all(np.abs(y.astype(np.float64) - exact) <= bound)


@needs_library
@pytest.mark.parametrize("isa", kernel_levels.params())
@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("rows,k,n", SHAPES)
def test_half_matmul_matches_numpy_on_every_path(rows, k, n, dtype, isa, monkeypatch):
    monkeypatch.setenv("MLA_DEPLOY_ISA", isa)  # read as onnxruntime creates the kernel
    _check_half_matmul(rows, k, n, dtype, library=True)


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("rows,k,n", SHAPES[::3])
def test_the_function_body_matches_numpy(rows, k, n, dtype):
    _check_half_matmul(rows, k, n, dtype, library=False)


@needs_library
@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("rows,k,n", [(1, 300, 128), (5, 300, 128), (64, 600, 64)])
def test_the_scalar_path_is_the_float32_sum_in_order(rows, k, n, dtype, monkeypatch):
    """MLA_DEPLOY_ISA=scalar runs the plain C path: each output the float32 sum over k, in order, of float32 products
    (no fused multiply-add), bit for bit; so the level a session is created at is the one that runs."""
    monkeypatch.setenv("MLA_DEPLOY_ISA", "scalar")
    rng = np.random.default_rng(k + rows)
    a = rng.standard_normal((rows, k)).astype(np.float32)
    w = _half_bits((rng.standard_normal((k, n)) * 0.1).astype(np.float32), dtype)
    y = _session(_one_op_model(k, n, dtype, w), True).run(None, {"a": a})[0]
    w32, in_order = _as_float64(w, dtype).astype(np.float32), np.zeros((rows, n), np.float32)
    for i in range(k):
        in_order = in_order + a[:, i : i + 1] * w32[i]  # float32 product, then float32 sum
    assert np.array_equal(y, in_order)


@needs_library
def test_half_matmul_keeps_leading_dimensions_and_runs_on_one_thread():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 3, 96)).astype(np.float32)
    w = rng.standard_normal((96, 128)).astype(np.float16)
    y = _session(_one_op_model(96, 128, weight=w, a_rank=3), True, threads=1).run(None, {"a": a})[0]
    assert y.shape == (2, 3, 128)
    np.testing.assert_allclose(y, a @ w.astype(np.float32), rtol=1e-5, atol=1e-5)


@needs_library
@pytest.mark.parametrize("b_shape,message", [
    ([96, 128], r"MatMulF16: B must be strips \[N / 64, K, 64\]"),
    ([2, 96, 32], r"MatMulF16: B must be strips \[N / 64, K, 64\]"),
    ([2, 80, 64], r"MatMulF16: A's last dimension must equal B's K"),
])
def test_half_matmul_refuses_a_malformed_weight_by_name(b_shape, message):
    session = _session(_one_op_model(96, 128, b_shape=b_shape), True)
    with pytest.raises(Exception, match=message):
        session.run(None, {"a": np.ones((1, 96), np.float32), "b": np.ones(b_shape, np.float16)})


@pytest.fixture(scope="module")
def half_demo(tmp_path_factory):
    built = {}

    def get(dtype: str):
        if dtype not in built:
            built[dtype] = tmp_path_factory.mktemp(f"{dtype}-demo") / "out"
            export(DEMO_CHECKPOINT, built[dtype], ExportOptions(dtype=dtype), progress=lambda m: None)
        return built[dtype]

    return get


@needs_library
@pytest.mark.parametrize("isa", kernel_levels.params())
@pytest.mark.parametrize("dtype", sorted(HALF))
def test_a_half_export_runs_the_kernel_and_its_function_body_alike(half_demo, dtype, isa, tmp_path, monkeypatch):
    """The demo's half export: its weights with whole 64-column strips go through the dtype's MatMul op (stored as
    strips), its routed experts through the dtype's RoutedExperts; with the library registered (on every path, the
    plain C one included) onnxruntime keeps those nodes, without it inlines their bodies; both give the same logits to
    float32 summation order and the same greedy tokens."""
    monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
    out, op_type = half_demo(dtype), kernels.HALF_MATMUL[dtype]
    experts, attention = kernels.ROUTED_EXPERTS[dtype], kernels.LATENT_ATTENTION[dtype]
    saved = onnx.load(out / "decode.onnx", load_external_data=False)
    assert sorted((f.domain, f.name) for f in saved.functions) == sorted(
        (kernels.DOMAIN, name) for name in (op_type, experts, attention))
    assert sum(n.op_type == op_type for n in saved.graph.node) >= 4 * 4  # per layer: q_a, q_b, o, mlp ...
    assert sum(n.op_type == experts for n in saved.graph.node) == 3  # the demo's MoE layers
    assert sum(n.op_type == attention for n in saved.graph.node) == 4  # its layers' attention, on the half caches
    on, off = ExportedModel(out), ExportedModel(out, RuntimeOptions(kernels=False))
    assert {op_type, experts, attention} <= optimized_op_types(on, io_spec.DECODE, tmp_path)
    assert not {op_type, experts, attention} & optimized_op_types(off, io_spec.DECODE, tmp_path)
    feed = prefill_feed(on.config, np.array([[1, 17, 300, 42, 9, 77, 5]]), cache_dtype=dtype)
    logits = [m.run(io_spec.PREFILL, feed)[io_spec.LOGITS] for m in (on, off)]
    scale = float(np.abs(logits[1]).max())
    assert float(np.abs(logits[0] - logits[1]).max()) <= 1e-4 * scale
    tokens = [Generator(m, SamplingParams(), stop_token_ids=()).generate([[1, 17, 300, 42]], 12).token_ids[0]
              for m in (on, off)]
    assert tokens[0] == tokens[1]


def test_inspect_says_which_ops_need_the_library_and_whether_it_was_built(half_demo, monkeypatch):
    from mla_deploy.inspection import format_report, inspect_path

    out = half_demo("bfloat16")
    report = inspect_path(out)
    decode_ops = report["kernels"]["ops"]["decode"]
    assert sorted(decode_ops) == ["mla_deploy::LatentAttentionBF16", "mla_deploy::MatMulBF16",
                                  "mla_deploy::RoutedExpertsBF16"]
    assert decode_ops["mla_deploy::MatMulBF16"] >= 16 and decode_ops["mla_deploy::RoutedExpertsBF16"] == 3
    line = next(line for line in format_report(report) if line.startswith("kernels"))
    assert "decode mla_deploy::LatentAttentionBF16 x4 mla_deploy::MatMulBF16 x" in line
    assert re.search(r"prefill mla_deploy::LatentAttentionChunkBF16 x4 [^,]*mla_deploy::MatMulBF16 x", line)
    assert ("built here: the weights are read as stored" in line) == BUILT
    monkeypatch.setattr(kernels, "library", lambda: None)
    line = next(line for line in format_report(inspect_path(out)) if line.startswith("kernels"))
    assert "was not built here (no C compiler at install)" in line and "float32 copies" in line
    assert "RoutedExperts' body runs every expert on every token" in line
