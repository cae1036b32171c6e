"""mla_deploy.LatentAttention (and its F16 / BF16 forms for half caches): MLA's absorbed decode attention core in the
kernel library against a float64 numpy reference with a float32 error bound, beside its ONNX function body; masks
(rows of different lengths, holes, a row that sees nothing), several slot ranges per row, heads and slots off the
register blocks; its errors; the choice an export makes; and the same export with the kernel and with onnxruntime's
ops."""

import dataclasses
import warnings

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from mla_deploy import kernels
from mla_deploy.config import MLAConfig
from mla_deploy.errors import ExportError
from mla_deploy.export import ExportOptions, export
from mla_deploy.export.attention import latent_attention_function
from mla_deploy.export.plan import resolve_decode_attention
from mla_deploy.export.opset import OPSET
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime.feeds import prefill_feed
from mla_deploy.runtime.speculative import DraftPolicy, Speculation
from mla_deploy.safetensors_io import bf16_to_float32, float32_to_bf16

import kernel_levels
from optimized_graph import optimized_op_types

needs_library = pytest.mark.skipif(kernels.library() is None,
                                   reason="the kernel library did not build on this machine (no compiler)")
NAMES = ["q_latent", "q_rope", "latent", "rope", "bias"]
CACHE_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
NOT_SEEN = float(np.finfo(np.float32).min)  # attention_bias's value for a slot a row does not see


def _model(dtype: str, long: bool = False, chunk: bool = False) -> bytes:
    """LatentAttention (or LatentAttentionLong: the same kernel, the long-cache function body; LatentAttentionChunk:
    T query tokens a row) as a one-op model."""
    types = [TensorProto.FLOAT, TensorProto.FLOAT, CACHE_TYPES[dtype], CACHE_TYPES[dtype], TensorProto.FLOAT]
    name = (kernels.LATENT_ATTENTION_CHUNK if chunk else kernels.LATENT_ATTENTION_LONG if long
            else kernels.LATENT_ATTENTION)[dtype]
    graph = helper.make_graph(
        [helper.make_node(name, NAMES, ["out"], domain=kernels.DOMAIN)], "one_op",
        [helper.make_tensor_value_info(n, t, None) for n, t in zip(NAMES, types)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    opsets = [
        helper.make_opsetid("", OPSET),
        helper.make_opsetid(kernels.DOMAIN, 1),
        helper.make_opsetid("com.microsoft", 1),
    ]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=11,
                              functions=[ir.serde.serialize_function(
                                  latent_attention_function(dtype, long, chunk=chunk))])
    return model.SerializeToString()


def _session(dtype: str, library: bool, threads: int, long: bool = False, chunk: bool = False) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library:
        so.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(_model(dtype, long, chunk), so, providers=["CPUExecutionProvider"])


def _cache_value(x: np.ndarray, dtype: str) -> tuple[ort.OrtValue, np.ndarray]:
    """The cache as the op gets it (bfloat16: its bit patterns bound with their ONNX type), and its values."""
    if dtype == "float32":
        return ort.OrtValue.ortvalue_from_numpy(x), x
    if dtype == "float16":
        h = x.astype(np.float16)
        return ort.OrtValue.ortvalue_from_numpy(h), h.astype(np.float32)
    bits = float32_to_bf16(x)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, TensorProto.BFLOAT16), bf16_to_float32(bits)


def _reference(ql, qr, latent, rope, bias) -> tuple[np.ndarray, np.ndarray]:
    """The attention in float64 (a row that sees no slot: the mean of every slot, as the graph's softmax gives when
    each score plus float32's lowest rounds to the same float), and a
    float32 bound per output: score errors of (d_c + d_r) 2^-24 sum |q||c| (plus the exponential's ~1e-6 relative)
    move each probability by at most twice that relatively, so the mixture moves by that times max |latent|; plus
    the mixture's own float32 sum."""
    b, h, dc = ql.shape
    out, bound = np.zeros((b, h, dc)), np.zeros((b, h, dc))
    for r in range(b):
        seen = bias[r].reshape(-1) > NOT_SEEN
        blind = not seen.any()
        seen |= blind
        lat, rop = latent[r][seen].astype(np.float64), rope[r][seen].astype(np.float64)
        scores = ql[r].astype(np.float64) @ lat.T + qr[r].astype(np.float64) @ rop.T + bias[r].reshape(-1)[seen]
        scores = np.zeros_like(scores) if blind else scores  # [h, n]
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[r] = p @ lat
        magnitude = np.abs(ql[r]) @ np.abs(lat).T + np.abs(qr[r]) @ np.abs(rop).T  # [h, n]
        score_error = (dc + qr.shape[-1]) * 2.0**-24 * magnitude.max(-1) + 1e-6  # [h]
        bound[r] = (2 * score_error[:, None] + len(lat) * 2.0**-24) * np.abs(lat).max() + 1e-7
    return out, bound


def _case(rng, b, h, dc, dr, cap, lengths, holes=False):
    ql = rng.standard_normal((b, h, dc)).astype(np.float32) * 0.3
    qr = rng.standard_normal((b, h, dr)).astype(np.float32) * 0.3
    latent = rng.standard_normal((b, cap, dc)).astype(np.float32)
    rope = rng.standard_normal((b, cap, dr)).astype(np.float32)
    bias = np.full((b, 1, 1, cap), NOT_SEEN, np.float32)
    for r, n in enumerate(lengths):
        bias[r, ..., :n] = 0.0
        if holes and n > 4:
            bias[r, ..., 1:n:3] = NOT_SEEN  # slots masked inside the row's length (attention_mask zeros)
    return ql, qr, latent, rope, bias


# (rows, heads, d_c, d_r, capacity, seen slots per row): one row (decode at batch 1), a batch of different lengths
# (one row that sees nothing), heads and slots off the 4 x 3 blocks, capacities of several 256-slot ranges per row,
# DeepSeek's widths and heads (float32 caches: outer products over 16 heads a panel), 8 heads (a panel of 8)
SHAPES = [(1, 4, 64, 16, 256, [100]), (5, 4, 64, 16, 256, [1, 7, 256, 0, 130]), (3, 5, 32, 8, 40, [40, 11, 2]),
          (2, 3, 48, 8, 700, [700, 301]), (2, 16, 512, 64, 600, [600, 257]), (2, 8, 128, 32, 300, [300, 77])]


# the op's function body, then the kernel on each instruction-set path this CPU has (MLA_DEPLOY_ISA, read as
# onnxruntime creates the kernel; the AVX-512 level runs the float32 outer products over 16 heads and p @ latent
# over 32 columns 16 lanes wide, the rest as AVX2)
PATHS = [pytest.param("function-body", id="function-body")] + [
    pytest.param(*level.values, id=level.id, marks=[needs_library, *level.marks]) for level in kernel_levels.params()]


def _forced(isa: str, monkeypatch) -> bool:
    """Whether the session registers the library; the path its kernels take."""
    if isa == "function-body":
        return False
    monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
    return True


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("b,h,dc,dr,cap,lengths", SHAPES)
@pytest.mark.parametrize("holes", [False, True])
def test_latent_attention_matches_numpy(b, h, dc, dr, cap, lengths, holes, threads, isa, monkeypatch):
    library = _forced(isa, monkeypatch)
    _check(
        np.random.default_rng(b * 1000 + h * 100 + cap), b, h, dc, dr, cap, lengths, holes, threads, library, "float32"
    )


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("b,h,dc,dr,cap,lengths", [SHAPES[1], SHAPES[3], SHAPES[4]])
def test_half_caches_are_read_as_stored(b, h, dc, dr, cap, lengths, dtype, isa, monkeypatch):
    """LatentAttentionF16 / BF16 widen the stored caches exactly: the same bound against the rounded caches."""
    library = _forced(isa, monkeypatch)
    _check(np.random.default_rng(cap), b, h, dc, dr, cap, lengths, True, 2, library, dtype)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("b,h,dc,dr,cap,lengths", SHAPES)
def test_the_long_cache_form_matches_numpy(b, h, dc, dr, cap, lengths, dtype, isa, monkeypatch):
    """LatentAttentionLong: the kernel under another name, and its body with the cache as MatMul's A operand."""
    library = _forced(isa, monkeypatch)
    _check(np.random.default_rng(cap + h), b, h, dc, dr, cap, lengths, True, 2, library, dtype, long=True)


def _check(rng, b, h, dc, dr, cap, lengths, holes, threads, library, dtype, long=False):
    ql, qr, latent, rope, bias = _case(rng, b, h, dc, dr, cap, lengths, holes)
    (latent_value, latent), (rope_value, rope) = _cache_value(latent, dtype), _cache_value(rope, dtype)
    feed = {"q_latent": ort.OrtValue.ortvalue_from_numpy(ql), "q_rope": ort.OrtValue.ortvalue_from_numpy(qr),
            "latent": latent_value, "rope": rope_value, "bias": ort.OrtValue.ortvalue_from_numpy(bias)}
    out = _session(dtype, library, threads, long).run_with_ort_values(["out"], feed)[0].numpy()
    assert out.dtype == np.float32 and out.shape == (b, h, dc)
    exact, bound = _reference(ql, qr, latent, rope, bias)
    assert np.all(np.abs(out - exact) <= bound)


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("h,cap,length,slot", [(16, 300, 300, 5), (16, 300, 300, 270), (4, 43, 43, 41), (4, 40, 40, 5)])
def test_a_nan_in_a_seen_slot_makes_its_row_nan_on_every_path(h, cap, length, slot, isa, monkeypatch):
    """A NaN rope value in a slot the row sees makes every head's score there NaN: the output is NaN, as the
    softmax of the function body gives, on every path (a vector body, a tail, another 256-slot range), where the
    kernel had dropped the slot's range or kept it by its exp's floor, by path; the other row is untouched."""
    library = _forced(isa, monkeypatch)
    ql, qr, latent, rope, bias = _case(np.random.default_rng(slot), 2, h, 64, 16, cap, [length, length])
    run = _session("float32", library, 2)

    def out(rope):
        feed = {"q_latent": ql, "q_rope": qr, "latent": latent, "rope": rope, "bias": bias}
        return run.run(["out"], feed)[0]

    clean = out(rope)
    rope = rope.copy()
    rope[0, slot, 3] = np.nan
    y = out(rope)
    assert np.isnan(y[0]).all() and np.array_equal(y[1], clean[1])


# (rows, tokens a row, heads, d_c, d_r, capacity, each row's first token's slot): a verification pass at batch 1, a
# batch whose rows start at different lengths (one at slot 0), heads off the blocks and ranges crossed by the tokens;
# at 16 heads and more over float32 caches the AVX-512 level takes a row's tokens in groups of up to 128 queries (17
# tokens of 16 heads, one row's first token seeing no slot at all: start -1; 32 heads: groups of 4 or fewer), smaller
# ones where few slot ranges hold a seen slot (a short cache keeps a many-core pool's threads busy)
CHUNKS = [(1, 5, 4, 64, 16, 256, [100]), (3, 4, 5, 32, 8, 300, [0, 254, 40]), (2, 9, 16, 512, 64, 600, [590, 3]),
          (2, 17, 16, 64, 16, 700, [-1, 650]), (1, 6, 32, 64, 8, 2100, [2000])]


@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("b,t,h,dc,dr,cap,starts", CHUNKS)
@pytest.mark.parametrize("holes", [False, True])
def test_the_chunk_form_gives_each_token_its_own_causal_attention(b, t, h, dc, dr, cap, starts, holes, dtype, isa,
                                                                   monkeypatch):
    """LatentAttentionChunk*: T query tokens a cache row [b, T, h, ·], token j of row r seeing the slots up to
    starts[r] + j (bias [b, 1, T, cap]); each against the float64 reference over its row's cache, and exactly the
    one-token op's output for the same query and bias row, but where a row's tokens go in groups (the AVX-512 level
    over float32 caches at 16 heads: the slots any of a group sees, each token's own ones weighted), which sums the
    same products in another order: there within the reference's bound of it. With holes, slots masked inside
    every token's length (attention_mask zeros), on one thread."""
    library = _forced(isa, monkeypatch)
    rng = np.random.default_rng(cap + t)
    ql = rng.standard_normal((b, t, h, dc)).astype(np.float32) * 0.3
    qr = rng.standard_normal((b, t, h, dr)).astype(np.float32) * 0.3
    (latent_value, latent), (rope_value, rope) = (_cache_value(rng.standard_normal((b, cap, w)).astype(np.float32),
                                                               dtype) for w in (dc, dr))
    bias = np.full((b, 1, t, cap), NOT_SEEN, np.float32)
    for r, start in enumerate(starts):
        for j in range(t):
            bias[r, 0, j, : start + j + 1] = 0.0
            if holes:
                bias[r, 0, j, 1 : start + j : 3] = NOT_SEEN
    feed = {"q_latent": ort.OrtValue.ortvalue_from_numpy(ql), "q_rope": ort.OrtValue.ortvalue_from_numpy(qr),
            "latent": latent_value, "rope": rope_value, "bias": ort.OrtValue.ortvalue_from_numpy(bias)}
    out = _session(dtype, library, 1 if holes else 2, chunk=True).run_with_ort_values(["out"], feed)[0].numpy()
    assert out.dtype == np.float32 and out.shape == (b, t, h, dc)
    rows = lambda x: np.repeat(x, t, axis=0)  # noqa: E731 - each cache row once per token
    exact, bound = _reference(ql.reshape(b * t, h, dc), qr.reshape(b * t, h, dr), rows(latent), rows(rope),
                              bias.transpose(0, 2, 1, 3).reshape(b * t, 1, 1, cap))
    assert np.all(np.abs(out.reshape(b * t, h, dc) - exact) <= bound)
    one, grouped = _session(dtype, library, 2), isa == "avx512" and dtype == "float32" and h % 16 == 0 and dc % 32 == 0
    bound = bound.reshape(b, t, h, dc)
    for j in range(t if library else 0):  # the kernel: one token's arithmetic, or a group's (its slots' union)
        token = {"q_latent": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(ql[:, j])),
                 "q_rope": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(qr[:, j])),
                 "latent": latent_value, "rope": rope_value,
                 "bias": ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(bias[:, :, j : j + 1]))}
        alone = one.run_with_ort_values(["out"], token)[0].numpy()
        assert np.all(np.abs(out[:, j] - alone) <= bound[:, j]) if grouped else np.array_equal(out[:, j], alone)


@needs_library
@pytest.mark.parametrize(
    "shapes,message",
    [
        (([2, 4, 64], [2, 4, 16], [2, 10, 64], [2, 10, 16], [2, 1, 1, 10]), None),  # well-formed: runs
        (
            ([2, 4, 64], [2, 3, 16], [2, 10, 64], [2, 10, 16], [2, 1, 1, 10]),
            "disagree on the rows, the heads or the widths",
        ),
        (
            ([2, 4, 64], [2, 4, 16], [2, 10, 32], [2, 10, 16], [2, 1, 1, 10]),
            "disagree on the rows, the heads or the widths",
        ),
        (
            ([2, 4, 64], [2, 4, 16], [2, 10, 64], [2, 9, 16], [2, 1, 1, 10]),
            "disagree on the rows, the heads or the widths",
        ),
        (
            ([2, 4, 64], [2, 4, 16], [2, 10, 64], [2, 10, 16], [2, 1, 1, 9]),
            r"bias must hold one value per query and cache slot",
        ),
        (
            ([2, 4, 40], [2, 4, 16], [2, 10, 40], [2, 10, 16], [2, 1, 1, 10]),
            "d_c must be a multiple of 16 and d_r of 8",
        ),
        (([2, 4, 64], [2, 4, 16], [2, 10, 64], [2, 10, 16, 1], [2, 1, 1, 10]), r"expected q_latent \[b, h, d_c\]"),
    ],
)
def test_latent_attention_refuses_malformed_inputs_by_name(shapes, message):
    session = _session("float32", True, 1)
    feed = {n: np.zeros(s, np.float32) for n, s in zip(NAMES, shapes)}
    if message is None:
        assert session.run(None, feed)[0].shape == (2, 4, 64)
    else:
        with pytest.raises(Exception, match=message):
            session.run(None, feed)


def test_the_choice_follows_heads_cache_dtype_and_widths():
    demo = MLAConfig.from_hf_json(DEMO_CHECKPOINT / "config.json")  # 4 heads, d_c 64, d_r 16
    v2lite = MLAConfig.from_hf_json(DEMO_CHECKPOINT.parent / "presets" / "v2lite.json")  # 16 heads
    assert resolve_decode_attention(demo, "auto") == "kernel"
    assert resolve_decode_attention(v2lite, "auto") == "avx512"  # 16 heads over float32 caches: by CPU
    assert resolve_decode_attention(v2lite, "auto", cache_dtype="bfloat16") == "kernel"  # no cast of the cache
    assert resolve_decode_attention(v2lite, "auto", cache_dtype="float16") == "kernel"
    assert resolve_decode_attention(v2lite, "kernel") == "kernel"  # asked for
    assert resolve_decode_attention(demo, "ops") == "ops"
    odd = dataclasses.replace(demo, kv_lora_rank=40)
    assert resolve_decode_attention(odd, "auto", cache_dtype="float16") == "ops"
    assert resolve_decode_attention(odd, "auto") == "ops"
    for asked in ("kernel", "avx512"):
        with pytest.raises(ExportError, match=f"--decode-attention {asked} needs kv_lora_rank a multiple of 16 and "
                                              "qk_rope_head_dim of 8 .* 40 and 16"):
            resolve_decode_attention(odd, asked)
    assert resolve_decode_attention(demo, "avx512") == "avx512"  # asked for
    with pytest.raises(ExportError, match="avx512 chooses by CPU over float32 caches; over bfloat16 caches the kernel "
                                          "runs on every CPU"):
        resolve_decode_attention(v2lite, "avx512", cache_dtype="bfloat16")
    with pytest.raises(ExportError, match="expected one of auto, kernel, avx512, ops"):
        resolve_decode_attention(demo, "fused")


@pytest.fixture(scope="module")
def avx512_demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("avx512-demo") / "out"
    export(DEMO_CHECKPOINT, out, ExportOptions(decode_attention="avx512"), progress=lambda m: None)
    return out


@needs_library
@pytest.mark.parametrize("isa", kernel_levels.params())
def test_the_avx512_choice_runs_the_kernel_only_where_the_kernels_run_avx512(avx512_demo, demo_export_dir, isa,
                                                                             tmp_path, monkeypatch):
    """decode_attention="avx512" (auto's over float32 caches at 16 heads and more) writes the decode graph's kernel
    under the name the library registers only at its AVX-512 level: there onnxruntime keeps the nodes, at every other
    level (MLA_DEPLOY_ISA) it inlines their bodies, onnxruntime's MatMuls. The verify and draft graphs' T tokens a row
    take the chunk kernel the same way; the prefill graph's chunks run the ops. Either way the export decodes the demo
    export's greedy tokens (its kernel's), 3 rows of different lengths, also through verification passes of
    prompt-lookup drafts."""
    monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
    model, reference = ExportedModel(avx512_demo), ExportedModel(demo_export_dir)
    assert (model.manifest["decode_attention"], reference.manifest["decode_attention"]) == ("avx512", "kernel")
    name = kernels.LATENT_ATTENTION_AVX512[False]  # the demo's 1024 positions: no long-cache form
    assert model.manifest["graphs"]["decode"]["op_counts"][f"{kernels.DOMAIN}::{name}"] == 4
    ops = optimized_op_types(model, "decode", tmp_path)
    assert (name in ops) == (isa == "avx512") and "MatMul" in ops, sorted(ops)
    graphs = model.manifest["graphs"]
    assert {"prefill", "verify", "draft"} <= set(graphs)
    assert not any("LatentAttention" in op for op in graphs["prefill"]["op_counts"]), graphs["prefill"]["op_counts"]
    chunk = kernels.LATENT_ATTENTION_CHUNK_AVX512
    for kind, layers in (("verify", 4), ("draft", 1)):  # the draft: the MTP layer
        counts = graphs[kind]["op_counts"]
        assert counts[f"{kernels.DOMAIN}::{chunk}"] == layers, counts
        assert [op for op in counts if "LatentAttention" in op] == [f"{kernels.DOMAIN}::{chunk}"], counts
    ops = optimized_op_types(model, "verify", tmp_path)
    assert (chunk in ops) == (isa == "avx512") and "MatMul" in ops, sorted(ops)
    assert kernels.isa() == isa
    from click.testing import CliRunner

    from mla_deploy.cli import main

    result = CliRunner().invoke(main, ["inspect", str(avx512_demo)])
    assert result.exit_code == 0, result.output
    report = " ".join(result.output.split())  # the kernels line, unwrapped
    assert ("run the kernel in this process" in report) == (isa == "avx512"), report
    assert (f"run onnxruntime's ops in this process (the kernels run {isa} code here)" in report) == (isa != "avx512")
    prompts = [[1, 17, 300, 42, 17, 300, 42, 17], [1, 5], [1, 900, 901, 902, 900, 901, 902, 900]]
    plain = Generator(reference, SamplingParams(), stop_token_ids=()).generate(prompts, 16).token_ids
    assert Generator(model, SamplingParams(), stop_token_ids=()).generate(prompts, 16).token_ids == plain
    monkeypatch.setattr(DraftPolicy, "lengths",  # draft whatever the proposer has, whatever the costs say
                        lambda self, acceptance, available: [0 if a is None else n
                                                             for a, n in zip(acceptance, available)])
    drafted = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", 3)).generate(
        prompts, 16)
    assert drafted.token_ids == plain and drafted.speculation.proposed > 0


@needs_library
def test_the_demo_decodes_the_same_with_the_kernel_and_with_onnxruntimes_ops(tmp_path):
    """The demo export's auto choice (the kernel) against the same export with decode_attention="ops": the same
    greedy tokens over 24 steps of 3 rows of different lengths, logits within float32 summation order."""
    outs = {}
    for choice in ("auto", "ops"):
        outs[choice] = tmp_path / choice
        result = export(DEMO_CHECKPOINT, outs[choice], ExportOptions(decode_attention=choice), progress=lambda m: None)
        counts = result.manifest["graphs"]["decode"]["op_counts"]
        assert result.manifest["decode_attention"] == ("kernel" if choice == "auto" else "ops")
        assert counts.get("mla_deploy::LatentAttention", 0) == (4 if choice == "auto" else 0)
    prompts = [[1, 17, 300, 42], [1, 5], [1, 900, 901, 902, 903, 904, 905, 906]]
    runs = {
        c: Generator(ExportedModel(d), SamplingParams(), stop_token_ids=()).generate(prompts, 24)
        for c, d in outs.items()
    }
    assert runs["auto"].token_ids == runs["ops"].token_ids
    models = {c: ExportedModel(d) for c, d in outs.items()}
    feed = prefill_feed(models["ops"].config, np.array([prompts[2]]))
    logits = {c: m.run("prefill", feed)["logits"] for c, m in models.items()}  # the prefill graph is the same
    assert np.array_equal(logits["auto"], logits["ops"])


def test_the_export_command_takes_both_choices(tmp_path):
    """`mla-deploy export --experts ... --decode-attention ...` reach the manifest; an unknown choice is refused by
    name, nothing written."""
    from click.testing import CliRunner

    from mla_deploy.cli import main
    from mla_deploy.presets import preset_config, write_random_checkpoint

    ckpt = write_random_checkpoint(preset_config("tiny-v3"), tmp_path / "ckpt", seed=0)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(ckpt), "-o", str(out), "--experts", "branches",
                                       "--decode-attention", "ops", "--no-verify"])
    assert result.exit_code == 0, result.output
    manifest = ExportedModel(out).manifest
    assert (manifest["experts"], manifest["decode_attention"]) == ("branches", "ops")
    for option, value in (("--experts", "dense"), ("--experts", "mixture"), ("--decode-attention", "fast")):
        refused = CliRunner().invoke(main, ["export", str(ckpt), "-o", str(tmp_path / "no"), option, value])
        assert refused.exit_code == 2 and option in refused.output and f"'{value}' is not one of" in refused.output
        assert not (tmp_path / "no").exists()


@needs_library
def test_a_library_built_before_the_level_query_reads_as_unknown(monkeypatch):
    """kernels.isa() over a library without MlaDeployIsa (built from older sources): None, which inspect reports as
    a library to rebuild, not an AttributeError."""
    monkeypatch.setattr(kernels.ctypes, "CDLL", lambda path: object())
    assert kernels.isa() is None


@needs_library
def test_a_cap_above_the_cpus_level_warns_which_path_runs(demo_export_dir, monkeypatch):
    """MLA_DEPLOY_ISA caps, never raises: asking for a level the CPU lacks (here one claiming only AVX2) warns with
    the level the kernels run, as a session registers the kernels; a cap at or below the CPU's, or none, says
    nothing."""
    monkeypatch.setattr(kernels, "isa", lambda: "avx2")  # dispatch.c's answer: the cap, limited to the CPU's level
    monkeypatch.setenv("MLA_DEPLOY_ISA", "avx512")
    with pytest.warns(RuntimeWarning, match="MLA_DEPLOY_ISA=avx512: this CPU lacks the avx512 path; the kernels run "
                                            "avx2"):
        ExportedModel(demo_export_dir)
    for cap in ("avx2", None):
        if cap is None:
            monkeypatch.delenv("MLA_DEPLOY_ISA")
        else:
            monkeypatch.setenv("MLA_DEPLOY_ISA", cap)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kernels.warn_above_cpu()
