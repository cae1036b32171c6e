"""mla_deploy.LatentAttentionQ8 (and its Q8F16 / Q8BF16 and Long forms): MLA's absorbed decode attention over an
int8 latent cache in the kernel library, against a float64 reference of the arithmetic latent_attention_q8.h defines
(the queries quantized per head, integer dot products, 16-bit probabilities per range of slots) with a float32 and
16-bit-probability error bound; every instruction-set path this CPU has, forced through MLA_DEPLOY_ISA, giving the
same bits; contexts across several ranges, rows of different lengths in one batch, a row of length 1, holes, a row
that sees nothing; its function body (DequantizeLinear, then float32) against the exact float64 attention; its errors;
and the demo exported with an int8 cache decoding the same tokens with the kernel and with the function body."""

import os

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from kernel_levels import LEVELS, cpu_level
from kernel_levels import params as levels
from mla_deploy import kernels
from mla_deploy.export import ExportOptions, export
from mla_deploy.export.attention import latent_attention_function, latent_attention_op
from mla_deploy.export.opset import OPSET
from mla_deploy.io_spec import CacheFormat
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from mla_deploy.safetensors_io import bf16_to_float32, float32_to_bf16

needs_library = pytest.mark.skipif(kernels.library() is None,
                                   reason="the kernel library did not build on this machine (no compiler)")
NAMES = ["q_latent", "q_rope", "latent", "latent_scale", "rope", "bias"]
ROPE_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
NOT_SEEN = float(np.finfo(np.float32).min)
HERE = LEVELS[: LEVELS.index(cpu_level()) + 1]  # the levels this CPU runs
RANGE = 512  # latent_attention_q8.h's Q8_RANGE: slots a task, and the span of one set of 16-bit probabilities
PMAX = 32767


def _model(rope: str, width: int, long: bool = False, chunk: bool = False) -> bytes:
    """LatentAttentionQ8* (LatentAttentionChunkQ8*: a chunk's queries) as a one-op model, carrying its function body."""
    cache = CacheFormat("int8", rope)
    types = [
        TensorProto.FLOAT,
        TensorProto.FLOAT,
        TensorProto.INT8,
        TensorProto.FLOAT,
        ROPE_TYPES[rope],
        TensorProto.FLOAT,
    ]
    graph = helper.make_graph(
        [helper.make_node(latent_attention_op(cache, long, chunk), NAMES, ["out"], domain=kernels.DOMAIN)], "one_op",
        [helper.make_tensor_value_info(n, t, None) for n, t in zip(NAMES, types)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    opsets = [
        helper.make_opsetid("", OPSET),
        helper.make_opsetid(kernels.DOMAIN, 1),
        helper.make_opsetid("com.microsoft", 1),
    ]
    model = helper.make_model(
        graph,
        opset_imports=opsets,
        ir_version=11,
        functions=[ir.serde.serialize_function(latent_attention_function(cache, long, width, chunk))],
    )
    return model.SerializeToString()


def _session(rope: str, width: int, level: str | None, threads: int = 1, long: bool = False,
             chunk: bool = False) -> ort.InferenceSession:
    """The kernel at `level` (MLA_DEPLOY_ISA, read as onnxruntime creates the kernel), or its function body (None)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if level is not None:
        so.register_custom_ops_library(str(kernels.library()))
        os.environ["MLA_DEPLOY_ISA"] = level
    try:
        return ort.InferenceSession(_model(rope, width, long, chunk), so, providers=["CPUExecutionProvider"])
    finally:
        os.environ.pop("MLA_DEPLOY_ISA", None)


def _case(rng, b, h, dc, dr, cap, lengths, rope="float32", holes=False):
    """Queries, an int8 cache quantized by io_spec's rule from standard normal entries, a rope cache, the bias; as
    feeds (rope's half types bound as such) and the rope's values."""
    ql = rng.standard_normal((b, h, dc)).astype(np.float32) * 0.1
    qr = rng.standard_normal((b, h, dr)).astype(np.float32) * 0.3
    latent = rng.standard_normal((b, cap, dc)).astype(np.float32)
    scale = np.maximum(np.abs(latent).max(-1, keepdims=True) / np.float32(127), np.finfo(np.float32).tiny)
    codes = np.clip(np.rint(latent / scale), -127, 127).astype(np.int8)
    r = rng.standard_normal((b, cap, dr)).astype(np.float32)
    if rope == "float16":
        stored, r = r.astype(np.float16), r.astype(np.float16).astype(np.float32)
        rope_value = ort.OrtValue.ortvalue_from_numpy(stored)
    elif rope == "bfloat16":
        bits = float32_to_bf16(r)
        rope_value, r = (
            ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.BFLOAT16),
            bf16_to_float32(bits),
        )
    else:
        rope_value = ort.OrtValue.ortvalue_from_numpy(r)
    bias = np.full((b, 1, 1, cap), NOT_SEEN, np.float32)
    for row, n in enumerate(lengths):
        bias[row, ..., :n] = 0.0
        if holes and n > 4:
            bias[row, ..., 1:n:3] = NOT_SEEN  # masked slots inside the row's length
    feed = {"q_latent": ql, "q_rope": qr, "latent": codes, "latent_scale": scale, "bias": bias}
    feed = {k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in feed.items()}
    feed["rope"] = rope_value
    return feed, (ql, qr, codes, scale[..., 0], r, bias)


def _run(session, feed) -> np.ndarray:
    return session.run_with_ort_values(["out"], feed)[0].numpy()


def _reference(ql, qr, codes, scale, rope, bias, quantized_queries=True):
    """The attention in float64 over the dequantized cache, with the kernel's queries (quantized per head as
    latent_attention_q8.h says) or the exact ones, and a bound per output on the kernel's distance from it: the
    16-bit probabilities (each within half a step of w · 32767 / max w over its range) move out[h, k] by at most
    sum_ranges e^(top_r - top) (max w_r / 65534) sum_i |code_i[k]| / sum p; float32 rounding of the scores (a few
    ulps of their magnitude, and the exponential's 2e-7) by twice that times max |latent|."""
    b, h, dc = ql.shape
    out, bound = np.zeros((b, h, dc)), np.zeros((b, h, dc))
    peak = np.abs(ql).max(-1, keepdims=True)  # [b, h, 1]
    qs = (peak / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q8 = np.where(qs > 0, np.clip(np.rint(ql / qs), -127, 127), 0).astype(np.float32)
    for r in range(b):
        seen = bias[r].reshape(-1) > NOT_SEEN
        blind = not seen.any()
        seen |= blind
        slots = np.flatnonzero(seen)
        c = codes[r][slots].astype(np.float64)
        sc = scale[r][slots].astype(np.float64)
        latent = c * sc[:, None]  # [n, d_c]
        rop = rope[r][slots].astype(np.float64)
        if quantized_queries:
            lat = (q8[r].astype(np.float64) @ c.T) * qs[r].astype(np.float64) * sc[None, :]  # [h, n]
        else:
            lat = ql[r].astype(np.float64) @ latent.T
        rs = qr[r].astype(np.float64) @ rop.T
        scores = np.zeros_like(lat) if blind else lat + rs + bias[r].reshape(-1)[slots]
        magnitude = np.abs(lat) + np.abs(qr[r]) @ np.abs(rop).T
        p = np.exp(scores - scores.max(-1, keepdims=True))  # [h, n]
        out[r] = (p @ latent) / p.sum(-1, keepdims=True)
        score_error = 4 * 2.0**-24 * magnitude.max(-1) + 4e-7  # [h]
        pairs = np.zeros((h, dc))
        for first in range(0, bias.shape[-1], RANGE):  # the ranges as the kernel splits the capacity
            inside = (slots >= first) & (slots < first + RANGE)
            if inside.any():
                w = p[:, inside] * sc[inside][None, :]  # [h, n_r]
                pairs += w.max(-1, keepdims=True) / (2 * PMAX) * np.abs(c[inside]).sum(0)[None, :] * 1.001
        bound[r] = pairs / p.sum(-1, keepdims=True) + 2 * score_error[:, None] * np.abs(latent).max() + 1e-6
    return out, bound


# (rows, heads, d_c, d_r, capacity, seen slots per row): one row at DeepSeek's widths across three ranges, rows of
# different lengths with a row of length 1 and one that sees nothing, heads and slots off the register blocks, a
# batch of DeepSeek's widths across ranges, 8 heads of d_c 128
SHAPES = [(1, 16, 512, 64, 1300, [1300]), (5, 4, 64, 16, 256, [1, 7, 256, 0, 130]), (3, 5, 32, 8, 40, [40, 11, 2]),
          (2, 3, 48, 8, 700, [700, 301]), (2, 16, 512, 64, 1100, [1100, 513]), (2, 8, 128, 32, 300, [300, 1]),
          (3, 20, 64, 16, 520, [513, 2, 256])]


@needs_library
@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("b,h,dc,dr,cap,lengths", SHAPES)
@pytest.mark.parametrize("holes", [False, True])
def test_the_kernel_matches_its_float64_arithmetic(b, h, dc, dr, cap, lengths, holes, threads, level):
    feed, arrays = _case(np.random.default_rng(b * 1000 + h * 100 + cap), b, h, dc, dr, cap, lengths, holes=holes)
    out = _run(_session("float32", dc, level, threads), feed)
    assert out.dtype == np.float32 and out.shape == (b, h, dc)
    exact, bound = _reference(*arrays)
    assert np.all(np.abs(out - exact) <= bound)


@needs_library
@pytest.mark.parametrize("rope", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("b,h,dc,dr,cap,lengths", [SHAPES[1], SHAPES[4], SHAPES[6]])
def test_every_level_gives_the_same_bits(b, h, dc, dr, cap, lengths, rope):
    """Every path does the same integer sums and float32 operations in the same order (latent_attention_q8.h), over
    every rope type; the half rope caches are read as stored."""
    feed, arrays = _case(np.random.default_rng(cap + h), b, h, dc, dr, cap, lengths, rope=rope, holes=True)
    outs = [_run(_session(rope, dc, level), feed) for level in HERE]
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])
    exact, bound = _reference(*arrays)
    assert np.all(np.abs(outs[0] - exact) <= bound)


@needs_library
@pytest.mark.parametrize("where", ["rope", "query", "infinite query"])
@pytest.mark.parametrize("slot", [5, 39, 270])
def test_a_nan_score_makes_its_row_nan_at_every_level(slot, where):
    """A NaN in a seen slot's rope value (every head's score there) or in a row's query (every score), or an infinite
    query value (its codes are not converted from inf / inf): the output is NaN at every level, as the function
    body's softmax gives, where the scalar path had skipped it and the vector ones had zeroed the range; the other
    row is untouched."""
    cap = 300
    feed, _ = _case(np.random.default_rng(slot), 2, 16, 64, 16, cap, [cap, cap])
    levels = [None, *HERE]  # the function body, then each level
    clean = {level: _run(_session("float32", 64, level), feed) for level in levels}
    if where == "rope":
        rope = feed["rope"].numpy().copy()
        rope[0, slot, 2] = np.nan
        feed["rope"] = ort.OrtValue.ortvalue_from_numpy(rope)
    else:
        q = feed["q_latent"].numpy().copy()
        q[0, 3, slot % 64] = np.nan if where == "query" else np.inf
        feed["q_latent"] = ort.OrtValue.ortvalue_from_numpy(q)
    for level in levels:
        y = _run(_session("float32", 64, level), feed)
        assert np.isnan(y[0] if where == "rope" else y[0, 3]).all(), level
        assert np.array_equal(y[1], clean[level][1]), level


@pytest.mark.parametrize("long", [False, True])
@pytest.mark.parametrize("b,h,dc,dr,cap,lengths", [SHAPES[1], SHAPES[2], SHAPES[4]])
def test_the_function_body_is_the_exact_dequantized_attention(b, h, dc, dr, cap, lengths, long):
    """Where the library is not registered: DequantizeLinear, then the float32 ops form (LatentAttentionLongQ8: the
    cache as MatMul's A operand), against float64 over the dequantized cache with the queries as given."""
    feed, arrays = _case(np.random.default_rng(cap), b, h, dc, dr, cap, lengths, holes=True)
    out = _run(_session("float32", dc, None, 2, long), feed)
    exact, _ = _reference(*arrays, quantized_queries=False)
    latent = arrays[2].astype(np.float64) * arrays[3][..., None]
    magnitude = np.abs(arrays[0]) @ np.abs(latent).transpose(0, 2, 1)  # [b, h, cap]
    bound = (2 * (dc + dr) * 2.0**-24 * magnitude.max(-1)[..., None] + 2e-6) * np.abs(latent).max() + cap * 2.0**-24 * 4
    assert np.all(np.abs(out - exact) <= bound)


@needs_library
def test_the_int8_queries_stay_near_the_exact_attention():
    """What the kernel's int8 queries cost on DeepSeek's widths: within a few hundredths of the exact attention's
    output scale here (scores of standard deviation ~2), where a wrong slot, head or scale is off by its whole size."""
    feed, arrays = _case(np.random.default_rng(7), 2, 16, 512, 64, 700, [700, 300])
    out = _run(_session("float32", 512, cpu_level()), feed)
    exact, _ = _reference(*arrays, quantized_queries=False)
    assert np.abs(out - exact).max() < 0.05 * np.abs(exact).max()


@needs_library
@pytest.mark.parametrize("change,message", [
    ({}, None),  # well-formed: runs
    ({"q_rope": (2, 3, 16)}, "disagree on the rows, the heads or the widths"),
    ({"latent": (2, 10, 32)}, "disagree on the rows, the heads or the widths"),
    ({"rope": (2, 9, 16)}, "disagree on the rows, the heads or the widths"),
    ({"latent_scale": (2, 10, 2)}, r"latent_scale must hold one scale per row and cache slot \[b, cap, 1\]"),
    ({"latent_scale": (2, 9, 1)}, r"latent_scale must hold one scale per row and cache slot"),
    ({"bias": (2, 1, 1, 9)}, r"bias must hold one value per query and cache slot"),
    ({"q_latent": (2, 4, 40), "latent": (2, 10, 40)}, "d_c must be a multiple of 16 and d_r of 8"),
    ({"rope": (2, 10, 16, 1)}, r"expected q_latent \[b, h, d_c\]"),
])
def test_the_kernel_refuses_malformed_inputs_by_name(change, message):
    shapes = {"q_latent": (2, 4, 64), "q_rope": (2, 4, 16), "latent": (2, 10, 64), "latent_scale": (2, 10, 1),
              "rope": (2, 10, 16), "bias": (2, 1, 1, 10), **change}
    feed = {n: np.zeros(s, np.int8 if n == "latent" else np.float32) for n, s in shapes.items()}
    session = _session("float32", shapes["latent"][-1], "avx2")
    if message is None:
        assert session.run(None, feed)[0].shape == (2, 4, 64)
    else:
        with pytest.raises(Exception, match=message):
            session.run(None, feed)


def _chunk_case(rng, b, t, h, dc, dr, cap, starts, rope="float32"):
    """A prefill chunk: T queries a row [b, T, h, ·] over the same caches as _case, query j of row r at slot
    starts[r] + j seeing slots 0 .. starts[r] + j (causal); as feeds, and the same arithmetic as b·T decode rows, each
    query a row over its own row's caches (the reference's form)."""
    feed, (ql, qr, codes, scale, r, _) = _case(rng, b, h, dc, dr, cap, [cap] * b, rope=rope)
    ql = rng.standard_normal((b, t, h, dc)).astype(np.float32) * 0.1
    qr = rng.standard_normal((b, t, h, dr)).astype(np.float32) * 0.3
    bias = np.full((b, 1, t, cap), NOT_SEEN, np.float32)
    for row, start in enumerate(starts):
        for j in range(t):
            bias[row, 0, j, : start + j + 1] = 0.0
    feed.update({"q_latent": ort.OrtValue.ortvalue_from_numpy(ql), "q_rope": ort.OrtValue.ortvalue_from_numpy(qr),
                 "bias": ort.OrtValue.ortvalue_from_numpy(bias)})
    rows = (ql.reshape(b * t, h, dc), qr.reshape(b * t, h, dr), np.repeat(codes, t, 0), np.repeat(scale, t, 0),
            np.repeat(r, t, 0), bias.reshape(b * t, 1, 1, cap))
    return feed, rows


# (rows, T queries a row, heads, d_c, d_r, capacity, the chunk's first slot per row): a chunk whose causal spans
# cross range boundaries at DeepSeek's widths, a row whose first query sees one slot beside one deep in its cache,
# heads and widths off the register blocks
CHUNKS = [(1, 5, 16, 512, 64, 600, [510]), (2, 3, 4, 64, 16, 300, [0, 290]), (2, 4, 5, 32, 8, 520, [511, 3])]


@needs_library
@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("b,t,h,dc,dr,cap,starts", CHUNKS)
def test_the_chunk_kernel_matches_its_float64_arithmetic(b, t, h, dc, dr, cap, starts, level):
    """LatentAttentionChunkQ8: each of a chunk's queries is one decode row over its row's caches, with its own causal
    bias row; every level, two threads."""
    feed, rows = _chunk_case(np.random.default_rng(cap + t), b, t, h, dc, dr, cap, starts)
    out = _run(_session("float32", dc, level, 2, chunk=True), feed)
    assert out.dtype == np.float32 and out.shape == (b, t, h, dc)
    exact, bound = _reference(*rows)
    assert np.all(np.abs(out.reshape(b * t, h, dc) - exact) <= bound)


@needs_library
@pytest.mark.parametrize("rope", ["float32", "bfloat16"])
def test_the_chunk_kernel_gives_the_same_bits_at_every_level_and_as_decode_rows(rope):
    """The chunk's queries give the bits LatentAttentionQ8 gives them as decode rows of their own (the same
    arithmetic, the cache rows shared), at every level."""
    b, t, h, dc, dr, cap, starts = CHUNKS[2]
    feed, rows = _chunk_case(np.random.default_rng(11), b, t, h, dc, dr, cap, starts, rope=rope)
    outs = [_run(_session(rope, dc, level, chunk=True), feed) for level in HERE]
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])
    decode_feed = {"q_latent": rows[0], "q_rope": rows[1], "latent": rows[2], "latent_scale": rows[3][..., None],
                   "bias": rows[5]}
    decode_feed = {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for k, v in decode_feed.items()}
    stored = feed["rope"].numpy() if rope == "float32" else None
    if stored is None:  # the bfloat16 rope as stored, repeated per query
        bits = float32_to_bf16(rows[4])
        decode_feed["rope"] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.BFLOAT16)
    else:
        decode_feed["rope"] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(np.repeat(stored, t, 0)))
    as_rows = _run(_session(rope, dc, cpu_level()), decode_feed)
    assert np.array_equal(outs[0].reshape(b * t, h, dc), as_rows)


@pytest.mark.parametrize("b,t,h,dc,dr,cap,starts", CHUNKS[1:])
def test_the_chunk_function_body_is_the_exact_dequantized_attention(b, t, h, dc, dr, cap, starts):
    """Where the library is not registered: the chunk op's body (DequantizeLinear, the T·h queries of a row as one
    MatMul's rows) against float64 with the queries as given."""
    feed, rows = _chunk_case(np.random.default_rng(cap), b, t, h, dc, dr, cap, starts)
    out = _run(_session("float32", dc, None, 2, chunk=True), feed).reshape(b * t, h, dc)
    exact, _ = _reference(*rows, quantized_queries=False)
    latent = rows[2].astype(np.float64) * rows[3][..., None]
    magnitude = np.abs(rows[0]) @ np.abs(latent).transpose(0, 2, 1)
    bound = (2 * (dc + dr) * 2.0**-24 * magnitude.max(-1)[..., None] + 2e-6) * np.abs(latent).max() + cap * 2.0**-24 * 4
    assert np.all(np.abs(out - exact) <= bound)


@needs_library
def test_the_demo_decodes_the_same_with_the_kernel_and_with_its_function_body(tmp_path):
    """The demo exported with an int8 cache: mla_deploy.LatentAttentionQ8 (int8 queries) and its function body (the
    library off: DequantizeLinear and onnxruntime's ops) give the same greedy tokens over 24 steps of 3 rows of
    different lengths, every level the kernel has here."""
    out = tmp_path / "int8"
    result = export(DEMO_CHECKPOINT, out, ExportOptions(cache_dtype="int8"), progress=lambda m: None)
    assert result.manifest["graphs"]["decode"]["op_counts"]["mla_deploy::LatentAttentionQ8"] == 4
    prompts = [[1, 17, 300, 42], [1, 5], [1, 900, 901, 902, 903, 904, 905, 906]]

    def tokens(**options):
        return Generator(ExportedModel(out, RuntimeOptions(**options)), SamplingParams(),
                         stop_token_ids=()).generate(prompts, 24).token_ids

    body = tokens(kernels=False)
    for level in HERE:
        os.environ["MLA_DEPLOY_ISA"] = level
        try:
            assert tokens() == body, level
        finally:
            os.environ.pop("MLA_DEPLOY_ISA")
