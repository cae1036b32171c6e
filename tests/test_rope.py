"""rope.py's YaRN against transformers' own rope initialisation, including the configs no tiny model uses."""

import dataclasses

import numpy as np
import pytest

from mla_deploy import rope
from mla_deploy.config import MLAConfig
from mla_deploy.presets import preset_config


def yarn_config(top: dict | None = None, preset: str = "tiny-v3", **scaling) -> dict:
    raw = {**preset_config(preset), "max_position_embeddings": 256, **(top or {})}
    raw.pop("rope_parameters", None)
    raw["rope_scaling"] = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, **scaling}
    return raw


@pytest.mark.parametrize("top, scaling", [
    ({}, {}), ({}, {"mscale": 0.707, "mscale_all_dim": 0.707}), ({}, {"mscale": 1.0, "mscale_all_dim": 0.5}),
    ({}, {"beta_fast": 16, "beta_slow": 2}),
    ({"rope_theta": 500000.0}, {"factor": 2.0, "beta_fast": 64}),
    ({}, {"mscale": 0.707}), ({}, {"attention_factor": 0.9}),  # mscale without mscale_all_dim; an explicit factor
    # DeepSeek-V2-Lite's own rope (d_r 64, factor 40, original 4096): the ramp spans dims 10..23
    ({"preset": "v2lite", "max_position_embeddings": 163840},
     {"factor": 40, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 0.707}),
    # an empty ramp (both correction dims at 0, then both at 7 = d_r/2 - 1): its end moved by 0.001, as
    # transformers does
    ({}, {"beta_fast": 32, "beta_slow": 32}),
    ({"rope_theta": 10.0, "max_position_embeddings": 4096},
     {"beta_fast": 1, "beta_slow": 2, "original_max_position_embeddings": 471}),
    # a ramp from dim 0 that the clip at d_r - 1 cuts short
    ({"preset": "v2lite", "rope_theta": 10.0, "max_position_embeddings": 163840},
     {"factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 1024, "beta_slow": 1}),
])
def test_yarn_frequencies_and_attention_factor_match_transformers(top, scaling):
    from transformers import DeepseekV2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    top = dict(top)
    raw = yarn_config(top, top.pop("preset", "tiny-v3"), **scaling)
    hf = DeepseekV2Config(**raw)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = MLAConfig.from_hf_dict(raw)
    # base ** x in float32 is the one step whose last bits depend on the CPU (numpy and torch choose their pow by
    # instruction set: 1-2 ulp apart on an AVX-512 machine); 4 ulp holds on any x86-64, a wrong ramp is ~1e5 ulp off
    np.testing.assert_array_max_ulp(rope.inv_freq(cfg), inv_freq.numpy(), maxulp=4)
    # the rest is float32 division, products and sums, the same bits on every CPU: fed torch's own powers, the blend
    # equals transformers' bit for bit (a float64 intermediate anywhere in it is 1-2 ulp off, which this catches)
    torch_pos_freqs = _torch_pos_freqs(cfg)
    np.testing.assert_array_equal(rope.yarn_blend(cfg, torch_pos_freqs), inv_freq.numpy())
    assert rope.attention_factor(cfg) == pytest.approx(factor, rel=1e-12)


def _torch_pos_freqs(cfg: MLAConfig) -> np.ndarray:
    """base^(2i / d_r) exactly as transformers' yarn initialisation computes it, with torch's pow on this CPU."""
    import torch

    dim = cfg.qk_rope_head_dim
    return (cfg.rope_theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)).numpy()


def test_without_mscale_fields_the_attention_factor_is_mscale_of_the_factor_alone():
    cfg = MLAConfig.from_hf_dict(yarn_config())
    assert rope.attention_factor(cfg) == pytest.approx(0.1 * np.log(8.0) + 1.0, rel=1e-12)
    assert rope.softmax_scale(cfg) == pytest.approx(cfg.qk_head_dim ** -0.5, rel=1e-12)  # no mscale_all_dim: unscaled
    assert rope.yarn_mscale(0.5, 3.0) == 1.0 and rope.yarn_mscale(1.0, 3.0) == 1.0  # no scaling at factor <= 1
    assert rope.yarn_mscale(2.0, 3.0) == pytest.approx(0.3 * np.log(2.0) + 1.0, rel=1e-12)


@pytest.mark.parametrize("scaling", [None, {"mscale": 1.0, "mscale_all_dim": 0.5}])
def test_cos_sin_tables_equal_transformers_at_long_positions(scaling):
    """The tables multiply position by frequency in float32, as transformers' rotary embedding does: at position
    8191 a float64 product differs from it by up to 4e-4 rad; float32 agrees to a few ulp."""
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    n = 8192
    raw = yarn_config({"max_position_embeddings": n}, **scaling) if scaling is not None else \
        {**preset_config("tiny-v3"), "max_position_embeddings": n, "rope_parameters": {"rope_type": "default",
                                                                                    "rope_theta": 10000.0}}
    cfg = MLAConfig.from_hf_dict(raw)
    hf = DeepseekV3RotaryEmbedding(DeepseekV3Config(**{**raw, "head_dim": cfg.qk_rope_head_dim}))
    assert hf.rope_type == cfg.rope_type
    cos_ref, sin_ref = hf(torch.zeros(1), torch.arange(n)[None])  # [1, n, d_r]: the two halves repeat
    cos, sin = rope.rope_tables(cfg, n)  # [n, d_r/2]
    np.testing.assert_allclose(cos, cos_ref[0, :, : cfg.qk_rope_head_dim // 2].numpy(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(sin, sin_ref[0, :, : cfg.qk_rope_head_dim // 2].numpy(), rtol=0, atol=2e-6)


def test_a_default_rope_ignores_yarn_fields_set_on_the_config():
    """The yarn fields are unused for rope type "default", even when a config built in code sets them."""
    cfg = dataclasses.replace(MLAConfig.from_hf_dict(preset_config("tiny-v3")), rope_type="default", rope_factor=40.0,
                              mscale=1.0, mscale_all_dim=0.707)  # under YaRN: a factor of 1.18 on cos / sin
    assert rope.softmax_scale(cfg) == cfg.qk_head_dim ** -0.5
    assert rope.attention_factor(cfg) == 1.0
