"""mla_deploy.QRoutedExperts4 / QRoutedExperts8: a MoE layer's routed experts over int4 / int8 weights in the kernels'
layout, against float64 numpy references, on every instruction-set path this CPU has and the plain C one, one and two
threads, with its ONNX function body as the fallback; tokens choosing overlapping experts, an expert nobody chose,
one token and 512."""

import numpy as np
import pytest
from onnx import TensorProto, helper
from quantized_ops import U, has_level, model, quantize_rows, session, signed_codes

from mla_deploy import kernels
from mla_deploy.export import layouts
from mla_deploy.export.quantize import dequantize, quantize
from mla_deploy.export.quantized_functions import qrouted_experts_function

needs_library = pytest.mark.skipif(kernels.library() is None,
                                   reason="the kernel library did not build on this machine (no compiler)")
ISAS = [pytest.param(isa, marks=pytest.mark.skipif(not has_level(isa), reason=f"this CPU has no {isa} level"))
        for isa in kernels.ISA_LEVELS]


class Layer:
    """E experts' gate, up (W [d, I]) and down (W [I, d]) quantized, their layout, and the dequantized weights."""

    def __init__(self, rng, experts: int, d: int, inter: int, bits: int, block: int):
        self.bits, self.block, self.d, self.inter = bits, block, d, inter

        def q(shape):
            return quantize((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), bits, block,
                            scale_dtype="float16")
        self.gate, self.up = [q((d, inter)) for _ in range(experts)], [q((d, inter)) for _ in range(experts)]
        self.down = [q((inter, d)) for _ in range(experts)]
        self.weights = layouts.routed_experts_layout(self.gate, self.up, self.down)

    def model(self, level: int) -> bytes:
        e = len(self.gate)
        inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", self.d]),
                  helper.make_tensor_value_info("dispatch", TensorProto.FLOAT, ["T", e])]
        return model(kernels.QROUTED_EXPERTS[self.bits], inputs, self.weights, qrouted_experts_function(self.bits),
                     block_size=self.block, accuracy_level=level)

    def reference(self, x: np.ndarray, dispatch: np.ndarray, level: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer in float64 and a bound on the kernel's distance from it, per output.
        Level 0: float32 rounding of fc1 (block + KB + 1 terms per output, as QMatMul), carried through silu · up
        (|d act| <= |d g| (1 + |g|) |u| + |silu(g)| |d u|), plus fc2's own rounding.
        Level 4: x quantized as the kernel does, fc1 from exact integer sums; the activations quantized again from
        float64 values, so where the kernel's float32 act lies within 1e-3 of a rounding tie its code may differ by
        one: such a code adds its step times |down| to the bound, and every other term float32's rounding."""
        y, bound = np.zeros((x.shape[0], self.d)), np.zeros((x.shape[0], self.d))
        for e in range(len(self.gate)):
            tokens = np.nonzero(dispatch[:, e])[0]
            if not len(tokens):
                continue
            w = dispatch[tokens, e].astype(np.float64)[:, None]
            gw, uw, dw = (dequantize(m).astype(np.float64) for m in (self.gate[e], self.up[e], self.down[e]))
            xs = x[tokens]
            if level == 0:
                x64 = xs.astype(np.float64)
                g, u = x64 @ gw, x64 @ uw
                kb1 = -(-self.d // self.block)
                dg, du = ((self.block + kb1 + 1) * U * (np.abs(x64) @ np.abs(m)) for m in (gw, uw))
                silu = g / (1 + np.exp(-g))
                act = silu * u
                # the kernel's e^x is within 2 ulp: silu's own rounding within 8 units of |act|
                d_act = dg * (1 + np.abs(g)) * np.abs(u) + np.abs(silu) * du + 8 * U * np.abs(act)
                out = act @ dw
                err = d_act @ np.abs(dw) + (self.block + self.inter + 2) * U * (np.abs(act) @ np.abs(dw))
            else:
                g, u = (self._level4(xs, m) for m in (self.gate[e], self.up[e]))
                act = g / (1 + np.exp(-g)) * u
                codes, scale = quantize_rows(act.astype(np.float32), self.block)  # [rows, KB, B], [rows, KB]
                steps = np.repeat(scale.astype(np.float64), self.block, axis=1)[:, : self.inter]  # [rows, I]
                kb2 = scale.shape[1]
                padded = np.zeros((len(tokens), kb2 * self.block))
                padded[:, : self.inter] = act
                amax = np.abs(padded.reshape(len(tokens), kb2, self.block)).max(-1)
                inv = np.repeat(127 / np.where(amax > 0, amax, 1), self.block, axis=1)[:, : self.inter]
                scaled = act * inv
                near_tie = np.abs(scaled - np.floor(scaled) - 0.5) < 1e-3
                act_q = codes.reshape(len(tokens), -1)[:, : self.inter] * steps
                out = act_q @ dw
                err = (near_tie * steps) @ np.abs(dw) + 1e-5 * (np.abs(act_q) @ np.abs(dw))
            y[tokens] += w * out
            bound[tokens] += np.abs(w) * err
        return y, bound + 1e-7 * np.abs(y).max()

    def _level4(self, xs: np.ndarray, qw) -> np.ndarray:
        codes, scale = quantize_rows(xs, self.block)
        sums = np.einsum("mjb,njb->mnj", codes, signed_codes(qw))
        return (sums * (qw.scales.astype(np.float32)[None] * scale[:, None]).astype(np.float64)).sum(-1)


def routing(rng, tokens: int, experts: int, chosen: int, unchosen: int) -> np.ndarray:
    """dispatch [T, E]: each token's `chosen` experts among all but expert `unchosen` (which no token chooses), with
    the router's softmax-like weights."""
    dispatch = np.zeros((tokens, experts), np.float32)
    candidates = [e for e in range(experts) if e != unchosen]
    for t in range(tokens):
        picked = rng.choice(candidates, size=chosen, replace=False)
        dispatch[t, picked] = rng.dirichlet(np.ones(chosen)).astype(np.float32)
    return dispatch


# (tokens, experts, chosen per token, d, I): one token (decode), a few, many (prefill: more than 64 rows per expert
# go through the kernels' 64-row chunks); d and I not whole blocks or groups
SHAPES = [(1, 8, 2, 70, 40), (5, 6, 3, 64, 48), (512, 8, 2, 70, 40)]


@needs_library
@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("isa", ISAS)
def test_routed_experts_match_numpy(isa, bits, block, level, monkeypatch):
    monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
    rng = np.random.default_rng(bits * 100 + block + level)
    for tokens, experts, chosen, d, inter in SHAPES:
        layer = Layer(rng, experts, d, inter, bits, block)
        x = rng.standard_normal((tokens, d)).astype(np.float32)
        dispatch = routing(rng, tokens, experts, chosen, unchosen=experts - 1)
        onnx_model = layer.model(level)
        outputs = [session(onnx_model, True, threads).run(None, {"X": x, "dispatch": dispatch})[0] for threads in (1, 2)]
        assert np.array_equal(outputs[0], outputs[1]), "Y receives the experts in the same order on any threads"
        expected, bound = layer.reference(x, dispatch, level)
        assert outputs[0].shape == (tokens, d)
        assert np.all(np.abs(outputs[0] - expected) <= bound), (tokens, experts, d, inter)


@needs_library
@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("bits", [4, 8])
def test_every_path_gives_the_same_bits(bits, level, monkeypatch):
    """The experts' products, their silu (one polynomial e^x in plain float operations) and their sums into Y are the
    same float32 operations on every path."""
    rng = np.random.default_rng(10 + bits + level)
    layer = Layer(rng, 8, 70, 40, bits, 32)
    x = rng.standard_normal((40, 70)).astype(np.float32) * 3
    dispatch = routing(rng, 40, 8, 3, unchosen=5)
    outputs = {}
    for isa in kernels.ISA_LEVELS:
        if has_level(isa):
            monkeypatch.setenv("MLA_DEPLOY_ISA", isa)
            outputs[isa] = session(layer.model(level), True).run(None, {"X": x, "dispatch": dispatch})[0]
    for isa, y in outputs.items():
        assert np.array_equal(y, outputs["scalar"]), isa


@pytest.mark.parametrize("library", [pytest.param(True, marks=needs_library, id="kernel"),
                                     pytest.param(False, id="function-body")])
@pytest.mark.parametrize("level", [0, 4])
@pytest.mark.parametrize("bits", [4, 8])
def test_routed_experts_with_or_without_the_library(bits, level, library):
    """The body runs every expert on every token and weighs them by dispatch (0 for the rest); it quantizes the
    activations as the kernel does, so both stay within the same reference's bound (the body's MatMuls add K terms in
    their own order: a looser float32 share)."""
    rng = np.random.default_rng(bits + level)
    layer = Layer(rng, 6, 70, 40, bits, 32)
    x = rng.standard_normal((9, 70)).astype(np.float32)
    dispatch = routing(rng, 9, 6, 2, unchosen=2)
    y = session(layer.model(level), library).run(None, {"X": x, "dispatch": dispatch})[0]
    expected, bound = layer.reference(x, dispatch, level)
    scale = np.abs(expected).max()
    assert np.all(np.abs(y - expected) <= bound + 2e-6 * scale)


@needs_library
def test_routed_experts_read_no_expert_when_no_token_chose_one():
    rng = np.random.default_rng(1)
    layer = Layer(rng, 4, 64, 32, 4, 32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    y = session(layer.model(4), True).run(None, {"X": x, "dispatch": np.zeros((3, 4), np.float32)})[0]
    assert y.shape == (3, 64) and not y.any()


@needs_library
def test_routed_experts_refuse_mismatched_weights_by_name():
    rng = np.random.default_rng(2)
    layer = Layer(rng, 4, 64, 32, 8, 16)  # fc2: I = 32 in two blocks of 16
    layer.weights["fc2_codes"] = layer.weights["fc2_codes"][:, :, :1]  # K blocks that do not cover I'
    layer.weights["fc2_scales"] = layer.weights["fc2_scales"][:, :, :1]
    s = session(layer.model(0), True)
    with pytest.raises(Exception, match=r"QRoutedExperts8: fc2's K blocks must cover fc1's I' activations"):
        s.run(None, {"X": np.ones((1, 64), np.float32), "dispatch": np.ones((1, 4), np.float32)})
