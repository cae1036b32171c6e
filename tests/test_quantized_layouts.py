"""export.layouts (the quantized kernels' weight layouts) and export.quantize's float16 scales: pure numpy, each
checked element by element against the layout's definition, and round trips."""

import numpy as np
import pytest

from mla_deploy.export import layouts
from mla_deploy.export.quantize import Quantization, dequantize, quantize, unpack_codes


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_float16_scales_are_rounded_before_the_codes(bits, block):
    """Each scale is max|W| / qmax rounded to float16, and the codes are rint(W / that scale) clipped: so the
    dequantized weight is exactly codes times the float16 scales a kernel reads."""
    rng = np.random.default_rng(bits + block)
    w = (rng.standard_normal((3 * block + 5, 9)) * rng.uniform(1e-3, 2, 9)).astype(np.float32)
    w[:, 2] = 0
    qw = quantize(w, bits, block, scale_dtype="float16")
    assert qw.scales.dtype == np.float16
    qmax = 2 ** (bits - 1) - 1
    padded = np.zeros((qw.codes.shape[1] * block, 9))
    padded[: w.shape[0]] = w
    blocks = padded.T.reshape(9, -1, block)
    expected = (np.abs(blocks).max(-1) / qmax).astype(np.float16)
    assert np.array_equal(qw.scales, expected)
    safe = np.where(expected == 0, 1, expected.astype(np.float64))[..., None]
    assert np.array_equal(unpack_codes(qw), np.clip(np.rint(blocks / safe), -qmax, qmax))
    deq = dequantize(qw)
    assert np.array_equal(
        deq, (unpack_codes(qw) * expected.astype(np.float32)[..., None]).reshape(9, -1)[:, : w.shape[0]].T
    )
    step = np.repeat(expected.astype(np.float64).T, block, axis=0)[: w.shape[0]]
    # half a step, plus what clipping at qmax can add when the rounded scale is below max|W| / qmax
    assert (np.abs(deq - w) <= step * (0.5 + qmax * 2.0**-11) + 1e-12).all()


def test_float16_scales_refuse_weights_beyond_their_range():
    with pytest.raises(ValueError, match="does not fit in float16"):
        quantize(np.full((32, 2), 1e6, np.float32), 4, 32, scale_dtype="float16")
    with pytest.raises(ValueError, match="scale_dtype='bfloat16'"):
        quantize(np.ones((32, 2), np.float32), 4, 32, scale_dtype="bfloat16")


def test_quantization_records_its_scale_dtype():
    q = Quantization(4, 32, scale_dtype="float16")
    assert q.to_dict()["scale_dtype"] == "float16" and Quantization.from_dict(q.to_dict()) == q
    assert q.bytes_per_weight() == 0.5 + 2 / 32 and Quantization(8, 32).bytes_per_weight() == 1 + 4 / 32
    legacy = {
        k: v for k, v in Quantization(4).to_dict().items() if k != "scale_dtype"
    }  # manifests written before the field
    assert Quantization.from_dict(legacy).scale_dtype == "float32"


SHAPES = [(100, 37), (256, 48), (17, 5), (64, 16)]  # K a multiple of the block or not, N a multiple of 16 or not


@pytest.mark.parametrize("bits", [4, 6, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("k,n", SHAPES)
def test_layout_places_every_code_where_the_kernels_read_it(bits, block, k, n):
    rng = np.random.default_rng(k * n + bits)
    qw = quantize(rng.standard_normal((k, n)).astype(np.float32), bits, block, scale_dtype="float16")
    codes, scales = layouts.qmatmul_layout(qw)
    g, kb = -(-n // 16), -(-k // block)
    assert codes.shape == (g, kb, 2 * block * bits) and codes.dtype == np.uint8
    assert scales.shape == (g, kb, 16) and scales.dtype == np.float16
    unsigned = unpack_codes(qw) + 2 ** (bits - 1)  # [N, KB, B]
    for col in range(n):
        gg, c = divmod(col, 16)
        for j in range(kb):
            assert scales[gg, j, c] == qw.scales[col, j]
            for kk in range(block):
                if bits == 8:
                    stored = codes[gg, j, 64 * (kk // 4) + 4 * c + kk % 4]
                else:
                    byte = codes[gg, j, 64 * (kk // 8) + 4 * c + kk % 4]
                    stored = byte & 0xF if kk % 8 < 4 else byte >> 4
                    if bits == 6:  # the high 2 bits of quad kk // 4, past the low nibbles' 8 B bytes
                        quad = kk // 4
                        high = codes[gg, j, 8 * block + 64 * (quad // 4) + 4 * c + kk % 4]
                        stored |= ((high >> (2 * (quad % 4))) & 3) << 4
                assert stored == unsigned[col, j, kk]
    if n % 16:  # padding columns: zero-point codes, zero scales
        assert not scales[-1, :, n % 16:].any()
    back = layouts.qmatmul_unlayout(codes, scales, k, n, bits, block)
    assert np.array_equal(back.codes, qw.codes) and np.array_equal(back.scales, qw.scales) and back.k == k
    assert np.array_equal(layouts.dequantize_layout(codes, scales, k, n, bits, block), dequantize(qw))


def test_layout_refuses_scales_the_kernels_cannot_hold():
    qw = quantize(np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32), 4, 32)  # float32 scales
    with pytest.raises(ValueError, match="not float16 values"):
        layouts.qmatmul_layout(qw)
    codes, scales = layouts.qmatmul_layout(quantize(np.ones((64, 16), np.float32), 4, 32, scale_dtype="float16"))
    with pytest.raises(ValueError, match="do not hold a 4-bit"):
        layouts.qmatmul_unlayout(codes, scales, 64, 16, 4, 16)


@pytest.mark.parametrize("bits", [4, 8])
def test_gate_up_columns_alternate_16_gate_columns_with_the_same_up_columns(bits):
    rng = np.random.default_rng(bits)
    d, inter = 40, 24  # I' = 32: two pairs of groups, the second half padding
    gate, up = (quantize(rng.standard_normal((d, inter)).astype(np.float32), bits, 16, scale_dtype="float16")
                for _ in range(2))
    both = layouts.gate_up_columns(gate, up)
    assert both.n == 64 and both.k == d
    w, g, u = dequantize(both), dequantize(gate), dequantize(up)
    assert np.array_equal(w[:, 0:16], g[:, 0:16]) and np.array_equal(w[:, 16:32], u[:, 0:16])
    assert np.array_equal(w[:, 32:40], g[:, 16:24]) and np.array_equal(w[:, 48:56], u[:, 16:24])
    assert not w[:, 40:48].any() and not w[:, 56:64].any()
    fc = layouts.routed_experts_layout(
        [gate, gate],
        [up, up],
        [quantize(rng.standard_normal((inter, d)).astype(np.float32), bits, 16, scale_dtype="float16")] * 2,
    )
    assert fc["fc1_codes"].shape == (2, 4, 3, 32 * bits) and fc["fc1_scales"].shape == (2, 4, 3, 16)
    assert fc["fc2_codes"].shape == (2, 3, 2, 32 * bits) and fc["fc2_scales"].shape == (2, 3, 2, 16)


def test_a_manifest_can_say_how_to_read_the_layout():
    entry = layouts.describe(4, 32)
    assert entry["layout"] == layouts.NAME and entry["zero_point"] == 8 and entry["scale_dtype"] == "float16"
    assert layouts.describe(8, 64)["zero_point"] == 128 and "64q+4c+t" in layouts.describe(8, 64)["run"]
