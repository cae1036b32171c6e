"""Decoupled RoPE for MLA: frequencies, YaRN scaling, and the cache layout of the roped key.

The formulas follow transformers' DeepseekV2/V3 (the reference), computed in float32 the way
it does so that long positions agree to the last bits that matter.

Layout. DeepSeek rotates interleaved pairs (x_{2i}, x_{2i+1}) by angle pos·θ_i. mla-deploy
de-interleaves the rope part (evens, then odds) and rotates halves, exactly as transformers'
DeepseekV3 does with `rope_interleave`. So the cached `k_pe` is in de-interleaved order
(transformers' V3 cache layout; V2's cache differs from it by `deinterleave_perm`). Scores are
identical either way. Torch-free: used by the torch model and by the exporter's tables.
"""

from __future__ import annotations

import math

import numpy as np

from .config import MLAConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """mscale(s, m) = 0.1·m·ln(s) + 1, or 1 where s <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq(cfg: MLAConfig) -> np.ndarray:
    """θ_i for i < d_r/2, with the YaRN blend of interpolated and extrapolated frequencies. [d_r/2] float32."""
    return yarn_blend(cfg, position_frequencies(cfg))


def position_frequencies(cfg: MLAConfig) -> np.ndarray:
    """base^(2i / d_r) for i < d_r/2, in float32 as transformers computes it. The one step whose last bit depends on
    the CPU: numpy's and torch's float32 pow pick their code by instruction set (1-2 ulp apart)."""
    dim = cfg.qk_rope_head_dim
    return np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))  # [d_r/2]


def yarn_blend(cfg: MLAConfig, pos_freqs: np.ndarray) -> np.ndarray:
    """The frequencies 1 / pos_freqs, or under YaRN their blend with 1 / (factor · pos_freqs) by the linear ramp over
    the correction range: float32 division, products and sums, each rounded as transformers rounds it."""
    dim = cfg.qk_rope_head_dim
    extrapolated = (1.0 / pos_freqs).astype(np.float32)
    if cfg.rope_type == "default":
        return extrapolated
    interpolated = (1.0 / (np.float32(cfg.rope_factor) * pos_freqs)).astype(np.float32)
    low, high = _yarn_correction_range(cfg)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation_weight = 1 - ramp
    return (interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight).astype(np.float32)


def _yarn_correction_range(cfg: MLAConfig) -> tuple[float, float]:
    dim, base, original = cfg.qk_rope_head_dim, cfg.rope_theta, cfg.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = math.floor(correction_dim(cfg.beta_fast))
    high = math.ceil(correction_dim(cfg.beta_slow))
    return max(low, 0), min(high, dim - 1)


def attention_factor(cfg: MLAConfig) -> float:
    """Multiplier on cos and sin: mscale(f, mscale) / mscale(f, mscale_all_dim) for YaRN, else 1."""
    if cfg.rope_type == "default":
        return 1.0
    if cfg.attention_factor is not None:
        return float(cfg.attention_factor)
    if cfg.mscale and cfg.mscale_all_dim:
        return float(yarn_mscale(cfg.rope_factor, cfg.mscale) / yarn_mscale(cfg.rope_factor, cfg.mscale_all_dim))
    return yarn_mscale(cfg.rope_factor)


def softmax_scale(cfg: MLAConfig) -> float:
    """qk_head_dim^-0.5, times mscale(f, mscale_all_dim)² under YaRN."""
    scale = cfg.qk_head_dim ** -0.5
    if cfg.rope_type != "default" and cfg.mscale_all_dim:
        m = yarn_mscale(cfg.rope_factor, cfg.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_tables(cfg: MLAConfig, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin for positions [0, n_positions), attention factor folded in. Each [n_positions, d_r/2] float32."""
    freqs = np.arange(n_positions, dtype=np.float32)[:, None] * inv_freq(cfg)[None, :]  # [n, d_r/2]
    factor = np.float32(attention_factor(cfg))
    return (np.cos(freqs) * factor).astype(np.float32), (np.sin(freqs) * factor).astype(np.float32)


def shifted_keys(k_pe: np.ndarray, cfg: MLAConfig, delta: int | np.ndarray) -> np.ndarray:
    """Cached roped keys [..., d_r] (rotate-half layout, attention factor folded in) moved by `delta` positions (one
    number, or one per key: [...]): RoPE's rotation by delta·θ_i, x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, the
    attention factor left as it is (it scales the cached key once, whatever its position). A key at position p
    becomes the key at p + delta up to float32 rounding: the cached one was rotated by fl(p·θ_i), this by delta·θ_i
    in float64, where a key roped at p + delta would be by fl((p + delta)·θ_i), so the angles differ by p·θ_i's and
    (p + delta)·θ_i's roundings (|Δangle| <= 2^-23 · p·θ_0). RoPE is relative, so scores between queries and keys
    all moved alike are unchanged. float32 out."""
    half = cfg.qk_rope_head_dim // 2
    angles = np.multiply.outer(np.asarray(delta, np.float64), inv_freq(cfg).astype(np.float64))  # [..., d_r/2]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    x1, x2 = k_pe[..., :half].astype(np.float32), k_pe[..., half:].astype(np.float32)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def deinterleave_perm(cfg: MLAConfig) -> np.ndarray:
    """Index map from the checkpoint's rope layout to the rotate-half layout: evens then odds when interleaved."""
    d = cfg.qk_rope_head_dim
    if not cfg.rope_interleave:
        return np.arange(d)
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
