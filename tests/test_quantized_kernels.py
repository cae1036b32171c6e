"""mla_deploy.QMatMul4 / QMatMul8, QBatchMatMul4 / QBatchMatMul8 and QGather4 / QGather8 (the kernel library's C,
built at install) against float64 numpy references, on every instruction-set path this CPU has (forced by
MLA_DEPLOY_ISA) and the plain C one, one and two threads; with their ONNX function bodies as the fallback; their
errors; and the library's registration (QRoutedExperts: tests/test_quantized_experts.py)."""

import numpy as np
import pytest
from onnx import TensorProto, helper, load_from_string

from mla_deploy import kernels
from mla_deploy.export.quantize import dequantize
from mla_deploy.export.linear import qgather_function
from quantized_ops import (U, activation_error_bound, has_level, level4_terms, model, qbatch_matmul_model,
                           qmatmul_model, quantized, session)

needs_library = pytest.mark.skipif(kernels.library() is None,
                                   reason="the kernel library did not build on this machine (no compiler)")
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not has_level(isa), reason=f"this CPU has no {isa} level "
                                                   "(dispatch.h: AVX2+FMA+F16C; AVX-512 F/BW/DQ/VL with VNNI)"))
        for isa in kernels.ISA_LEVELS]


def shapes(block: int) -> list[tuple[int, int, int]]:
    """(M, K, N): one row (decode), a few (batched decode), many (prefill, row tiles with a ragged last one); K a
    whole number of blocks or not (the last block zero-padded), shorter than one block too; N a whole number of
    16-column groups or not."""
    return [
        (1, 2 * block + 5, 37),
        (3, block - 3, 50),
        (8, 3 * block, 64),
        (64, block + 7, 130),
        (512, 2 * block + 1, 20),
    ]


def float_bound(a: np.ndarray, w_deq: np.ndarray, block: int) -> np.ndarray:
    """Accuracy level 0: per block a chain of fused multiply-adds (block terms), then one per block into the sum
    (KB terms): within (block + KB + 1) · 2^-24 · sum |a| |w'| of the exact product."""
    kb = -(-a.shape[1] // block)
    return (block + kb + 1) * U * (np.abs(a.astype(np.float64)) @ np.abs(w_deq.astype(np.float64)))


@needs_library
@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("isa", ISAS)
def test_qmatmul_matches_numpy(isa, bits, block, level, monkeypatch):
    monkeypatch.setenv("MLA_DEPLOY_ISA", isa)  # read as onnxruntime creates the kernel
    rng = np.random.default_rng(bits * 1000 + block * 10 + level)
    for i, (m, k, n) in enumerate(shapes(block)):
        qw, codes, scales = quantized((rng.standard_normal((k, n)) * 0.1).astype(np.float32), bits, block)
        w_deq = dequantize(qw)
        a = rng.standard_normal((m, k)).astype(np.float32)
        a[0, : min(block, k)] = 0  # an all-zero block of activations: scale 0, codes 0
        onnx_model = qmatmul_model(k, n, bits, block, level, codes, scales)
        results = [session(onnx_model, True, threads).run(None, {"A": a})[0] for threads in (1, 2)]
        assert results[0].shape == (m, n) and results[0].dtype == np.float32
        assert np.array_equal(results[0], results[1]), "one and two threads must add in the same order"
        y = results[0].astype(np.float64)
        exact = a.astype(np.float64) @ w_deq.astype(np.float64)
        if level == 0:
            assert np.all(np.abs(y - exact) <= float_bound(a, w_deq, block)), (m, k, n)
        else:
            terms = level4_terms(a, qw)  # the same int8 activations, the integer sums exact
            bound = (-(-k // block) + 1) * U * np.abs(terms).sum(-1)  # KB float32 fused multiply-adds
            assert np.all(np.abs(y - terms.sum(-1)) <= bound), (m, k, n)
            # against float activations: each moved by at most half its block's int8 step
            assert np.all(np.abs(y - exact) <= activation_error_bound(a, w_deq, block) + bound), (m, k, n)


def assert_product_within_bounds(y: np.ndarray, a: np.ndarray, qw, level: int, what) -> None:
    """Y = A @ W' of one weight, by the bounds test_qmatmul_matches_numpy states."""
    y, block, k = y.astype(np.float64), qw.block, a.shape[1]
    w_deq = dequantize(qw)
    exact = a.astype(np.float64) @ w_deq.astype(np.float64)
    if level == 0:
        assert np.all(np.abs(y - exact) <= float_bound(a, w_deq, block)), what
    else:
        terms = level4_terms(a, qw)
        bound = (-(-k // block) + 1) * U * np.abs(terms).sum(-1)
        assert np.all(np.abs(y - terms.sum(-1)) <= bound), what
        assert np.all(np.abs(y - exact) <= activation_error_bound(a, w_deq, block) + bound), what


def any_order_bound(a: np.ndarray, qw, level: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference A @ W' [M, N] and how far a product adding its K terms in any order (a function body's MatMul)
    may be from it: level 0 against the float activations, level 4 against the kernels' int8 terms."""
    k = a.shape[1]
    if level == 0:
        w_deq = dequantize(qw).astype(np.float64)
        return a.astype(np.float64) @ w_deq, (k + 2) * U * (np.abs(a.astype(np.float64)) @ np.abs(w_deq))
    terms = level4_terms(a, qw)
    return terms.sum(-1), (k + 2) * U * np.abs(terms).sum(-1) * 2


def stacked(rng, heads: int, k: int, n: int, bits: int, block: int):
    """Per head h a quantized W_h [K, N]; and the heads' codes and scales stacked [H, ...] as QBatchMatMul takes."""
    per_head = [quantized((rng.standard_normal((k, n)) * 0.1).astype(np.float32), bits, block) for _ in range(heads)]
    return [q for q, _, _ in per_head], np.stack([c for _, c, _ in per_head]), np.stack([s for _, _, s in per_head])


@needs_library
@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("isa", ISAS)
def test_qbatch_matmul_multiplies_each_head_by_its_own_weight(isa, bits, block, level, monkeypatch):
    """QBatchMatMul (the per-head W^UK / W^UV): every row's head h times weight h, for every head, within the one
    weight's bounds, at every row count of shapes() (K and N ragged); one and two threads add in the same order, and
    each head's result is QMatMul's over that head's weight bit for bit."""
    monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
    rng = np.random.default_rng(bits * 1000 + block * 10 + level + 5)
    heads = 3
    for m, k, n in shapes(block):
        weights, codes, scales = stacked(rng, heads, k, n, bits, block)
        a = rng.standard_normal((m, heads, k)).astype(np.float32)
        a[0, 1, : min(block, k)] = 0  # an all-zero block of activations
        onnx_model = qbatch_matmul_model(k, n, bits, block, level, codes, scales)
        results = [session(onnx_model, True, threads).run(None, {"A": a})[0] for threads in (1, 2)]
        assert results[0].shape == (m, heads, n) and results[0].dtype == np.float32
        assert np.array_equal(results[0], results[1]), "one and two threads must add in the same order"
        for h, qw in enumerate(weights):
            rows = np.ascontiguousarray(a[:, h])  # [M, K]: head h of every row
            assert_product_within_bounds(results[0][:, h], rows, qw, level, (h, m, k, n))
            one = session(qmatmul_model(k, n, bits, block, level, codes[h], scales[h]), True).run(None, {"A": rows})[0]
            assert np.array_equal(results[0][:, h], one), (h, m, k, n)


@pytest.mark.parametrize("library", [pytest.param(True, marks=needs_library, id="kernel"),
                                     pytest.param(False, id="function-body")])
@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("bits", [4, 8])
def test_qbatch_matmul_with_or_without_the_library(bits, level, library):
    """The same batched model through the kernel and through its stock-ONNX body: both within the bounds of
    test_qmatmul_keeps_leading_dimensions_with_or_without_the_library, head by head."""
    rng = np.random.default_rng(11 + bits + level)
    heads, m, k, n, block = 4, 5, 150, 45, 32
    weights, codes, scales = stacked(rng, heads, k, n, bits, block)
    a = rng.standard_normal((m, heads, k)).astype(np.float32)
    y = session(qbatch_matmul_model(k, n, bits, block, level, codes, scales), library).run(None, {"A": a})[0]
    assert y.shape == (m, heads, n)
    for h, qw in enumerate(weights):
        exact, bound = any_order_bound(np.ascontiguousarray(a[:, h]), qw, level)
        assert np.all(np.abs(y[:, h].astype(np.float64) - exact) <= bound), h


@needs_library
@pytest.mark.parametrize(
    "a_shape,codes_heads,message",
    [
        ((1, 2, 64), 3, r"QBatchMatMul8: A's heads \(its second dimension\) must equal the first dimension of codes"),
        ((3, 64), 3, r"QBatchMatMul8: expected A \[M, H, K\], codes \[H, G, KB, bytes\]"),
        ((1, 3, 60), 3, r"QBatchMatMul8: A's last dimension must equal the attribute K"),
    ],
)
def test_qbatch_matmul_refuses_mismatched_heads_by_name(a_shape, codes_heads, message):
    rng = np.random.default_rng(1)
    _, codes, scales = stacked(rng, codes_heads, 64, 20, 8, 32)
    onnx_model = qbatch_matmul_model(64, 20, 8, 32, 4, codes, scales, a_shape=[None] * len(a_shape))
    with pytest.raises(Exception, match=message):
        session(onnx_model, True).run(None, {"A": np.ones(a_shape, np.float32)})


@needs_library
@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_every_path_gives_the_same_bits(bits, level, monkeypatch):
    """Every path does the same float32 operations in the same order (qmatmul.h), so forcing a lower level changes
    no bit of Y: a path that read a code or a scale from the wrong place would."""
    rng = np.random.default_rng(bits + level)
    k, n, block = 200, 70, 32
    _, codes, scales = quantized(rng.standard_normal((k, n)).astype(np.float32), bits, block)
    onnx_model = qmatmul_model(k, n, bits, block, level, codes, scales)
    a = rng.standard_normal((100, k)).astype(np.float32)
    outputs = {}
    for isa in kernels.ISA_LEVELS:
        if has_level(isa):
            monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
            outputs[isa] = session(onnx_model, True).run(None, {"A": a})[0]
    for isa, y in outputs.items():
        assert np.array_equal(y, outputs["scalar"]), isa


@needs_library
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("level", [0, 4])
def test_a_non_finite_activation_gives_its_rows_nan_on_every_path(level, value, monkeypatch):
    """A float product with NaN (or infinity times a mixed-sign column) is NaN: at accuracy level 4 a block holding
    one quantizes to a NaN scale on every path, where its max-abs scan had given finite garbage that differed by
    path; the other rows are untouched."""
    rng = np.random.default_rng(7)
    k, n, block = 96, 40, 32
    _, codes, scales = quantized(rng.standard_normal((k, n)).astype(np.float32), 8, block)
    onnx_model = qmatmul_model(k, n, 8, block, level, codes, scales)
    a = rng.standard_normal((9, k)).astype(np.float32)
    clean = session(onnx_model, True).run(None, {"A": a})[0]
    for column in (3, 31, 95):  # the first block, the end of a block, the last one
        a_bad = a.copy()
        a_bad[4, column] = value
        for isa in kernels.ISA_LEVELS:
            if has_level(isa):
                monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
                y = session(onnx_model, True).run(None, {"A": a_bad})[0]
                assert np.isnan(y[4]).all() or (value == np.inf and not np.isfinite(y[4]).any()), (isa, column)
                assert np.array_equal(np.delete(y, 4, 0), np.delete(clean, 4, 0)), (isa, column)


@needs_library
@pytest.mark.parametrize("bits", [4, 8])
def test_a_block_too_small_to_scale_to_127_quantizes_to_zeros_on_every_path(bits, monkeypatch):
    """127 / max|a| overflows to infinity below max|a| = 127 / FLT_MAX (3.7e-37, subnormals too): such a block is all
    zeros at level 4 (an error below 1e-36 |W|), where its codes had been -128 on the SIMD paths and undefined
    behaviour on the plain C one (a whole row of them: any O(1) block would round the garbage away); the other rows
    keep their codes."""
    rng = np.random.default_rng(bits)
    k, n, block = 96, 24, 32
    _, codes, scales = quantized(rng.standard_normal((k, n)).astype(np.float32), bits, block)
    onnx_model = qmatmul_model(k, n, bits, block, 4, codes, scales)
    a = rng.standard_normal((3, k)).astype(np.float32)
    tiny = a.copy()
    tiny[1] = np.where(np.arange(k) % 2, -2e-37, 2e-37).astype(np.float32)
    tiny[1, 5] = 1e-44  # a subnormal
    monkeypatch.setenv("MLA_DEPLOY_ISA", "scalar")
    expected = session(onnx_model, True).run(None, {"A": np.where(np.abs(tiny) < 1e-30, 0, tiny)})[0]
    assert not expected[1].any() and expected[[0, 2]].all()
    for isa in kernels.ISA_LEVELS:
        if has_level(isa):
            monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
            assert np.array_equal(session(onnx_model, True).run(None, {"A": tiny})[0], expected), isa


@pytest.mark.parametrize("library", [pytest.param(True, marks=needs_library, id="kernel"),
                                     pytest.param(False, id="function-body")])
@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_qmatmul_keeps_leading_dimensions_with_or_without_the_library(bits, level, library):
    """The same model through the kernel and through its stock-ONNX body (onnxruntime without the library): both
    within the references' bounds; the body's MatMul adds in its own order (K terms)."""
    rng = np.random.default_rng(7 + bits + level)
    k, n, block = 150, 45, 64
    qw, codes, scales = quantized(rng.standard_normal((k, n)).astype(np.float32), bits, block)
    a = rng.standard_normal((2, 3, k)).astype(np.float32)
    y = session(qmatmul_model(k, n, bits, block, level, codes, scales, a_shape=[2, None, k]), library).run(
        None, {"A": a}
    )[0]
    assert y.shape == (2, 3, n)
    exact, bound = any_order_bound(a.reshape(6, k), qw, level)
    assert np.all(np.abs(y.reshape(6, n).astype(np.float64) - exact) <= bound)


@needs_library
@pytest.mark.parametrize(
    "change,message",
    [
        (
            dict(codes_shape=(3, 4, 128)),
            r"QMatMul4: B must be codes \[3, 4, 256\] and scales \[3, 4, 16\] "
            r"for a 4-bit \[100, 40\] weight in blocks of 32",
        ),
        (dict(k=120), r"QMatMul4: A's last dimension must equal the attribute K"),
        (dict(block=24), r"QMatMul4: block_size must be 16, 32, 64 or 128"),
        (dict(level=2), r"QMatMul4: accuracy_level must be 0"),
    ],
)
def test_qmatmul_refuses_what_it_cannot_multiply_by_name(change, message):
    rng = np.random.default_rng(0)
    _, codes, scales = quantized(rng.standard_normal((100, 40)).astype(np.float32), 4, 32)
    if "codes_shape" in change:
        codes = np.zeros(change["codes_shape"], np.uint8)
    onnx_model = qmatmul_model(100, 40, 4, change.get("block", 32), change.get("level", 4), codes, scales,
                               a_shape=["M", change.get("k", 100)])
    with pytest.raises(Exception, match=message):
        session(onnx_model, True).run(None, {"A": np.ones((1, change.get("k", 100)), np.float32)})


def gather_model(k: int, n: int, bits: int, block: int, codes, scales, ids_shape) -> bytes:
    ids = helper.make_tensor_value_info("ids", TensorProto.INT64, ids_shape)
    return model(kernels.QGATHER[bits], [ids], {"codes": codes, "scales": scales}, qgather_function(bits),
                 K=k, N=n, block_size=block)


@pytest.mark.parametrize("library", [pytest.param(True, marks=needs_library, id="kernel"),
                                     pytest.param(False, id="function-body")])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("bits", [4, 6, 8])
def test_qgather_reads_a_heads_columns_as_embedding_rows(bits, block, library):
    """A tied head W = Eᵀ [d, V]: token v's embedding row is column v, dequantized exactly (codes times float16
    scales are float32 values); negative ids count from the end, as Gather's."""
    rng = np.random.default_rng(bits + block)
    d, vocab = 2 * block + 3, 75  # d padded to whole blocks, V to whole groups
    qw, codes, scales = quantized(rng.standard_normal((d, vocab)).astype(np.float32), bits, block)
    ids = np.array([[0, 74, 16, -1], [15, 31, 32, 3]], np.int64)
    rows = session(gather_model(d, vocab, bits, block, codes, scales, [2, 4]), library, threads=2).run(
        None, {"ids": ids}
    )[0]
    assert rows.shape == (2, 4, d) and np.array_equal(rows, dequantize(qw).T[ids])


@needs_library
def test_qgather_refuses_an_id_outside_the_vocabulary():
    _, codes, scales = quantized(np.ones((32, 20), np.float32), 8, 32)
    s = session(gather_model(32, 20, 8, 32, codes, scales, [None]), True)
    with pytest.raises(Exception, match=r"QGather8: id 20 is outside \[-20, 20\)"):
        s.run(None, {"ids": np.array([3, 20], np.int64)})


@needs_library
def test_quantized_ops_register_at_the_plain_c_level(monkeypatch):
    """At the plain C level (MLA_DEPLOY_ISA=scalar, or a CPU without AVX2) the library still registers the quantized
    ops, whose scalar path runs anywhere: a graph without the function body runs on the kernel alone."""
    monkeypatch.setenv("MLA_DEPLOY_ISA", "scalar")
    rng = np.random.default_rng(3)
    qw, codes, scales = quantized(rng.standard_normal((64, 16)).astype(np.float32), 4, 32)
    bare = qmatmul_model(64, 16, 4, 32, 0, codes, scales)
    without_body = load_from_string(bare)
    del without_body.functions[:]  # only the registered kernel can run it now
    a = rng.standard_normal((2, 64)).astype(np.float32)
    y = session(without_body.SerializeToString(), True).run(None, {"A": a})[0]
    assert np.all(np.abs(y - a @ dequantize(qw)) <= float_bound(a, dequantize(qw), 32))
