"""export/quantize.py against a reference written element by element, and onnxruntime's MatMulNBits running
the packed weights: exact against the dequantized weights (accuracy_level 0), and within its stated error
with int8 activations (accuracy_level 4)."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from types import SimpleNamespace

from mla_deploy.export.quantize import Quantization, dequantize, per_head_rounded_kv_b, quantize, unpack_codes


def reference(w: np.ndarray, bits: int, block: int):
    """Codes [N, k_blocks, B] (signed) and scales, one block at a time."""
    k, n = w.shape
    k_blocks = -(-k // block)
    qmax = 2 ** (bits - 1) - 1
    codes = np.zeros((n, k_blocks, block), np.int64)
    scales = np.zeros((n, k_blocks), np.float32)
    for col in range(n):
        for j in range(k_blocks):
            values = [float(w[r, col]) if r < k else 0.0 for r in range(j * block, (j + 1) * block)]
            scale = np.float32(max(abs(v) for v in values) / qmax)
            scales[col, j] = scale
            for i, v in enumerate(values):
                codes[col, j, i] = 0 if scale == 0 else min(qmax, max(-qmax, round(v / float(scale))))
    return codes, scales


SHAPES = [(64, 24), (80, 7), (128, 5)]  # K a multiple of the block or not


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_codes_and_scales_equal_the_reference(bits, block, shape):
    rng = np.random.default_rng(bits * 100 + block)
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 3, shape[1]).astype(np.float32)
    w[:, 0] = 0  # an all-zero column: scale 0, codes 0
    qw = quantize(w, bits, block)
    codes, scales = reference(w, bits, block)
    assert qw.codes.dtype == np.uint8 and qw.codes.shape == (shape[1], -(-shape[0] // block), block * bits // 8)
    assert (qw.scales == scales).all() and (unpack_codes(qw) == codes).all()
    deq = dequantize(qw)
    assert deq.shape == w.shape and deq.dtype == np.float32
    bound = np.repeat(scales.T, block, axis=0)[: shape[0]] / 2  # [K, N]: half a step per element
    assert (np.abs(deq - w) <= bound * (1 + 1e-6) + 1e-12).all()
    assert (deq[:, 0] == 0).all()


def matmul_nbits(qw, m: int, accuracy_level: int) -> ort.InferenceSession:
    k, n = qw.k, qw.n
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft", K=k, N=n,
                            bits=qw.bits, block_size=qw.block, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "q", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])],
                              [numpy_helper.from_array(qw.codes, "B"), numpy_helper.from_array(qw.scales, "scales")])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("m", [1, 5])
def test_matmulnbits_computes_with_the_dequantized_weights(bits, block, m):
    rng = np.random.default_rng(block + m)
    k, n = 256, 48
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05
    x = rng.standard_normal((m, k)).astype(np.float32)
    qw = quantize(w, bits, block)
    exact = x.astype(np.float64) @ dequantize(qw).astype(np.float64)
    (y,) = matmul_nbits(qw, m, accuracy_level=0).run(None, {"A": x})
    np.testing.assert_allclose(y, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    # int8 activations inside the kernel: each row quantized to 8 bits, per-block error of a 127-step scale
    (y4,) = matmul_nbits(qw, m, accuracy_level=4).run(None, {"A": x})
    assert np.abs(y4 - exact).max() <= 0.02 * np.abs(exact).max()


def test_unsupported_bits_and_blocks_are_refused():
    w = np.ones((32, 4), np.float32)
    with pytest.raises(ValueError, match="bits=3"):
        quantize(w, 3, 32)
    with pytest.raises(ValueError, match="block=24"):
        quantize(w, 4, 24)


def test_chunked_columns_quantize_as_one():
    rng = np.random.default_rng(5)
    w = rng.standard_normal((100, 37)).astype(np.float32)
    whole, chunked = quantize(w, 4, 32), quantize(w, 4, 32, chunk_bytes=8 * 4 * 32 * 3)  # 3 columns per chunk
    assert (whole.codes == chunked.codes).all() and (whole.scales == chunked.scales).all()


@pytest.mark.parametrize("bits, block", [(8, 32), (8, 16), (4, 32)])
def test_per_head_rounding_blocks_each_product_along_what_it_sums(bits, block):
    """kv_b [h·(d_nope+d_v), d_c]: head h's W^UK [d_nope, d_c] is quantized as a weight [K = d_nope, N = d_c] (q_nope
    @ W^UK sums over d_nope) and W^UV^T [d_c, d_v] as [K = d_c, N = d_v] (o_latent @ W^UV^T sums over d_c), d_nope and
    d_v not whole blocks; each element within half its block's scale; and rounding twice changes nothing, so the
    export may quantize the already rounded kv_b and get the codes of the original."""
    cfg = SimpleNamespace(num_attention_heads=3, qk_nope_head_dim=40, v_head_dim=24, kv_lora_rank=64)
    h, dn, dv, dc = 3, 40, 24, 64
    rng = np.random.default_rng(bits + block)
    kv_b = rng.standard_normal((h * (dn + dv), dc)).astype(np.float32)
    q = Quantization(8, block, scale_dtype="float16", per_head_bits=bits)
    rounded = per_head_rounded_kv_b(cfg, kv_b, q)
    assert rounded.shape == kv_b.shape and rounded.dtype == kv_b.dtype
    for head in range(h):
        rows = slice(head * (dn + dv), (head + 1) * (dn + dv))
        uk, uv = kv_b[rows][:dn], kv_b[rows][dn:]  # [d_nope, d_c], [d_v, d_c]
        expected_uk = dequantize(quantize(uk, bits, block, scale_dtype="float16"))
        expected_uv = dequantize(quantize(uv.T, bits, block, scale_dtype="float16")).T
        assert np.array_equal(rounded[rows][:dn], expected_uk) and np.array_equal(rounded[rows][dn:], expected_uv)
        step = quantize(uk, bits, block, scale_dtype="float16").scales.astype(np.float64)  # [d_c, KB]
        bound = np.repeat(step.T, block, axis=0)[:dn] * (0.5 + 2 ** (bits - 1) * 2.0**-11)  # [d_nope, d_c]
        assert np.all(np.abs(rounded[rows][:dn] - uk) <= bound)
    assert np.array_equal(per_head_rounded_kv_b(cfg, rounded, q), rounded)
