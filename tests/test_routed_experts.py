"""mla_deploy.RoutedExperts (and its F16 / BF16 forms): a MoE layer's routed experts, each on the tokens that chose it
(the kernel library's C, built at install) against a float64 numpy reference, with its ONNX function body as the
fallback; its weight layout; its errors; and the demo export run through it and through its body (half exports:
tests/test_half_kernels.py)."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from mla_deploy import io_spec, kernels
from mla_deploy.export import ExportOptions, export
from mla_deploy.export.moe import routed_experts_function
from mla_deploy.export.opset import OPSET
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from mla_deploy.runtime.feeds import prefill_feed
from mla_deploy.safetensors_io import bf16_to_float32, float32_to_bf16
from mla_deploy.verify import verify_export

import kernel_levels
from optimized_graph import optimized_op_types

needs_library = pytest.mark.skipif(kernels.library() is None,
                                   reason="the kernel library did not build on this machine (no compiler)")


def test_fc1_strips_pair_32_gate_columns_with_the_same_up_columns_zero_padded():
    gate = np.arange(40 * 7, dtype=np.float32).reshape(40, 7) + 1  # HF [I, d], I = 40 -> I' = 64
    up = -gate
    fc1 = kernels.expert_fc1_strips(gate, up)
    assert fc1.shape == (2, 7, 64)
    for j, k, c in [(0, 0, 0), (0, 6, 31), (1, 3, 7)]:  # strip j, input k, column c < 32: gate column 32 j + c
        assert fc1[j, k, c] == gate[32 * j + c, k] and fc1[j, k, 32 + c] == up[32 * j + c, k]
    assert not fc1[1, :, 8:32].any() and not fc1[1, :, 40:].any()  # I = 40: columns 40..63 of I' are padding


def test_fc2_strips_are_downs_transpose_zero_padded_to_whole_strips():
    down = np.arange(70 * 24, dtype=np.float32).reshape(70, 24) + 1  # HF [d, I], d = 70 -> d' = 128, I = 24 -> I' 32
    fc2 = kernels.expert_fc2_strips(down)
    assert fc2.shape == (2, 32, 64)
    assert fc2[0, 5, 9] == down[9, 5] and fc2[1, 23, 5] == down[69, 23]
    assert not fc2[:, 24:].any() and not fc2[1, :, 6:].any()


def _experts(rng, e: int, d: int, inter: int):
    """HF-shaped gate, up [E, I, d] and down [E, d, I], float32."""
    scale = 1.0 / np.sqrt(d)
    return [
        (rng.standard_normal(shape) * scale).astype(np.float32)
        for shape in ((e, inter, d), (e, inter, d), (e, d, inter))
    ]


ONNX_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def _rounded(w: np.ndarray, dtype: str) -> np.ndarray:
    """W rounded to `dtype` and widened back: the weights a half op multiplies by."""
    if dtype == "float16":
        return w.astype(np.float16).astype(np.float32)
    return bf16_to_float32(float32_to_bf16(w)) if dtype == "bfloat16" else w


def _stored(strips: np.ndarray, name: str, dtype: str) -> onnx.TensorProto:
    if dtype == "float32":
        return numpy_helper.from_array(strips, name)
    bits = strips.astype(np.float16) if dtype == "float16" else float32_to_bf16(strips)
    return helper.make_tensor(name, ONNX_TYPES[dtype], strips.shape, np.ascontiguousarray(bits).tobytes(), raw=True)


def _one_op_model(gate, up, down, dtype: str = "float32") -> bytes:
    e, _, d = gate.shape
    fc1 = np.stack([kernels.expert_fc1_strips(gate[i], up[i]) for i in range(e)])
    fc2 = np.stack([kernels.expert_fc2_strips(down[i]) for i in range(e)])
    graph = helper.make_graph(
        [
            helper.make_node(
                kernels.ROUTED_EXPERTS[dtype], ["x", "dispatch", "fc1", "fc2"], ["y"], domain=kernels.DOMAIN
            )
        ],
        "one_op",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", d]),
            helper.make_tensor_value_info("dispatch", TensorProto.FLOAT, ["T", e]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[_stored(fc1, "fc1", dtype), _stored(fc2, "fc2", dtype)],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(kernels.DOMAIN, 1)],
        functions=[ir.serde.serialize_function(routed_experts_function(dtype))],
        ir_version=11,
    )
    return model.SerializeToString()


def _session(model: bytes, library: bool, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if library:
        so.register_custom_ops_library(str(kernels.library()))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _reference(x, dispatch, gate, up, down) -> tuple[np.ndarray, np.ndarray]:
    """The layer in float64, and a bound on float32 accumulation error per output: each expert's products are
    K-term dot products (the textbook K x 2^-24 x sum |a||w|), scaled by the dispatch weight."""
    x, dispatch = x.astype(np.float64), dispatch.astype(np.float64)
    gate, up, down = (w.astype(np.float64) for w in (gate, up, down))
    y, bound = np.zeros_like(x), np.zeros_like(x)
    d, inter = x.shape[1], gate.shape[1]
    for t, e in zip(*np.nonzero(dispatch)):
        g, u = gate[e] @ x[t], up[e] @ x[t]
        act = g / (1 + np.exp(-g)) * u
        y[t] += dispatch[t, e] * (down[e] @ act)
        # the activations' own error (relative ~d 2^-24 through gate and up) carried through down, plus down's sum
        act_err = (
            (d * 2.0**-24 * 4)
            * (np.abs(gate[e]) @ np.abs(x[t]) + np.abs(up[e]) @ np.abs(x[t]))
            * (1 + np.abs(g) + np.abs(u))
        )
        bound[t] += abs(dispatch[t, e]) * (np.abs(down[e]) @ (inter * 2.0**-24 * np.abs(act) + act_err))
    return y, bound + 1e-7 * np.abs(y).max()


# (tokens, experts, chosen per token, d, I): one token (decode at batch 1), a few (batched decode: each expert's rows
# in register blocks), many (prefill: more than 12 rows per expert, d and I' across the kernel's 256-row passes); d and
# I whole strips or padded (the tiny test checkpoints: d 64, I 24; the demo: 256, 160)
SHAPES = [(1, 8, 2, 256, 160), (3, 8, 2, 64, 24), (8, 8, 2, 300, 40), (16, 8, 2, 256, 160), (16, 6, 3, 70, 40),
          (40, 4, 2, 96, 64), (64, 8, 2, 256, 160), (512, 16, 4, 300, 300)]


@needs_library
@pytest.mark.parametrize("isa", kernel_levels.params())
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens,e,k,d,inter", SHAPES)
def test_routed_experts_match_numpy_on_every_path(tokens, e, k, d, inter, threads, isa, monkeypatch):
    monkeypatch.setenv("MLA_DEPLOY_ISA", isa)  # read as onnxruntime creates the kernel
    _check_against_numpy(tokens, e, k, d, inter, threads, True, "float32")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tokens,e,k,d,inter", SHAPES)
def test_the_function_body_matches_numpy(tokens, e, k, d, inter, threads):
    _check_against_numpy(tokens, e, k, d, inter, threads, False, "float32")


@needs_library
@pytest.mark.parametrize("isa", kernel_levels.params())
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("tokens,e,k,d,inter", [SHAPES[0], SHAPES[2], SHAPES[4], SHAPES[7]])
def test_half_routed_experts_match_numpy_on_the_rounded_weights(tokens, e, k, d, inter, dtype, isa, monkeypatch):
    """RoutedExpertsF16 / BF16 widen the stored weights exactly: the same bound against the rounded weights."""
    monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
    _check_against_numpy(tokens, e, k, d, inter, 2, True, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("tokens,e,k,d,inter", [SHAPES[0], SHAPES[4]])
def test_the_half_function_bodies_match_numpy(tokens, e, k, d, inter, dtype):
    _check_against_numpy(tokens, e, k, d, inter, 2, False, dtype)


def _check_against_numpy(tokens, e, k, d, inter, threads, library, dtype):
    rng = np.random.default_rng(tokens * 100 + e * 10 + k + d + inter)
    gate, up, down = (_rounded(w, dtype) for w in _experts(rng, e, d, inter))
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    dispatch = np.zeros((tokens, e), np.float32)
    for t in range(tokens):
        dispatch[t, rng.choice(e, k, replace=False)] = rng.uniform(0.1, 2.5, k)
    if tokens > 2:
        dispatch[1] = 0.0  # a token whose chosen weights all underflowed: no routed output
        dispatch[:, e - 1] = 0.0  # an expert nobody chose
    y = _session(_one_op_model(gate, up, down, dtype), library, threads).run(None, {"x": x, "dispatch": dispatch})[0]
    assert y.dtype == np.float32 and y.shape == (tokens, d)
    exact, bound = _reference(x, dispatch, gate, up, down)
    assert np.all(np.abs(y - exact) <= bound)
    if tokens > 2:
        assert not y[1].any()


@needs_library
@pytest.mark.parametrize("shapes,message", [
    (([4, 64], [4, 8], [8, 1, 64, 64], [8, 1, 32, 64]), None),  # well-formed: runs
    (([4, 64], [4, 8], [8, 0, 64, 64], [8, 1, 0, 64]), None),  # I' = 0: runs, and adds nothing
    (([4, 64], [3, 8], [8, 1, 64, 64], [8, 1, 32, 64]), "disagree on the tokens or the experts"),
    (([4, 64], [4, 8], [7, 1, 64, 64], [8, 1, 32, 64]), "disagree on the tokens or the experts"),
    (([4, 64], [4, 8], [8, 1, 48, 64], [8, 1, 32, 64]), r"fc1 must be \[E, I'/32, d, 64\]"),
    (([4, 64], [4, 8], [8, 1, 64, 64], [8, 1, 64, 64]), r"fc1 must be \[E, I'/32, d, 64\]"),  # fc2's I' is not fc1's
    (([4, 64], [4, 8], [8, 1, 64, 64], [8, 2, 32, 64]), r"d' = d rounded up to 64"),
    (([4, 64], [4, 8], [8, 64, 64], [8, 1, 32, 64]), r"expected X \[T, d\], dispatch \[T, E\]"),
])
def test_routed_experts_refuse_malformed_inputs_by_name(shapes, message):
    names = ["x", "dispatch", "fc1", "fc2"]
    graph = helper.make_graph(
        [helper.make_node(kernels.ROUTED_EXPERTS["float32"], names, ["y"], domain=kernels.DOMAIN)], "one_op",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(kernels.DOMAIN, 1)], ir_version=11
    )
    session = _session(model.SerializeToString(), True, 1)
    feed = {n: np.ones(s, np.float32) for n, s in zip(names, shapes)}
    if message is None:
        y = session.run(None, feed)[0]
        assert y.shape == (4, 64)
        if shapes[2][1] == 0:  # no intermediate columns: every expert adds an empty sum
            assert not y.any()
    else:
        with pytest.raises(Exception, match=message):
            session.run(None, feed)


@needs_library
def test_the_demo_export_runs_its_experts_in_the_kernel_and_its_function_body_alike(demo_export_dir, tmp_path):
    """The float32 demo picks "kernel" (one RoutedExperts per MoE layer, strips in weights.bin); registered, onnxruntime
    keeps the nodes; not, it inlines the body. Prefill at 9 tokens and batched decode at 3 rows: the same logits to
    float32 summation order, the same greedy tokens."""
    op_type = kernels.ROUTED_EXPERTS["float32"]
    saved = onnx.load(demo_export_dir / "decode.onnx", load_external_data=False)
    assert sorted(f.name for f in saved.functions) == sorted([op_type, kernels.LATENT_ATTENTION["float32"]])
    on, off = ExportedModel(demo_export_dir), ExportedModel(demo_export_dir, RuntimeOptions(kernels=False))
    assert on.manifest["experts"] == "kernel"
    moe_layers = on.config.num_hidden_layers - on.config.first_k_dense_replace
    assert on.manifest["graphs"][io_spec.DECODE]["op_counts"][f"{kernels.DOMAIN}::{op_type}"] == moe_layers
    for kind in (io_spec.PREFILL, io_spec.DECODE):
        assert op_type in optimized_op_types(on, kind, tmp_path)
    feed = prefill_feed(on.config, np.array([[1, 17, 300, 42, 9, 77, 5, 1000, 3]]))
    logits = [m.run(io_spec.PREFILL, feed)[io_spec.LOGITS] for m in (on, off)]
    assert float(np.abs(logits[0] - logits[1]).max()) <= 1e-4 * float(np.abs(logits[1]).max())
    prompts = [[1, 17, 300, 42], [1, 5], [1, 900, 901, 902, 903]]
    tokens = [Generator(m, SamplingParams(), stop_token_ids=()).generate(prompts, 10).token_ids for m in (on, off)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("variant", ["v2_group_limited", "v3_lora_group_yarn"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_onnxruntime_moe_experts_verify_against_the_source(checkpoint_dir, tmp_path, variant, dtype):
    """experts="moe": one com.microsoft MoE per layer, fed DeepSeek's choice as masked log-weights, for both routers
    (V2's softmax with group-limited greedy choice, V3's sigmoid with its selection-only bias and normalised top-k):
    verify passes at the dtype's tolerance, and the graph has no If left."""
    out = tmp_path / "out"
    export(checkpoint_dir(variant)[0], out, ExportOptions(dtype=dtype, experts="moe"),
           progress=lambda m: None)
    model = ExportedModel(out)
    assert model.manifest["experts"] == "moe"
    counts = model.manifest["graphs"][io_spec.DECODE]["op_counts"]
    assert counts["com.microsoft::MoE"] == model.config.num_hidden_layers - model.config.first_k_dense_replace
    assert "If" not in counts
    assert verify_export(out, checkpoint_dir(variant)[0], steps=4).passed
