"""Weight surgery for the graphs: pure functions from HF tensors to the matrices the graphs multiply by.

Every MatMul weight is stored [in, out] (the transpose of the HF [out, in] layout). The rope rows of
the query and of kv_a_proj_with_mqa are permuted once here into rotate-half order (mla_deploy.rope),
so the graphs never de-interleave at run time.

Absorption, per head h, with W^UK_h = kv_b[h, :d_nope] and W^UV_h = kv_b[h, d_nope:] ([·, d_c]):
  fused:    W^QK_h = W^UK_hᵀ · W^UQ_h[nope rows]        [d_c, in]   -> stored [in, h·d_c]
            W^UVO  = [W^O_h · W^UV_h]_h                  [d, h·d_c]  -> stored [h·d_c, d]
            computed in float64, then cast.
  factored: W^UK [h, d_nope, d_c] and W^UV transposed [h, d_c, d_v], applied as batched matmuls.
"""

from __future__ import annotations

from enum import Enum

import numpy as np

from ..config import MLAConfig
from ..rope import deinterleave_perm


class AbsorbMode(str, Enum):
    FUSED = "fused"
    FACTORED = "factored"
    AUTO = "auto"


def split_heads(cfg: MLAConfig, q_weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF query weight [h·(d_nope+d_r), in] -> nope rows [h, d_nope, in], rope rows [h, d_r, in] (rotate-half order)."""
    h, dn, dr = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    w = q_weight.reshape(h, dn + dr, -1)  # [h, d_nope + d_r, in]
    return w[:, :dn], w[:, dn:][:, deinterleave_perm(cfg)]


def split_kv_b(cfg: MLAConfig, kv_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj.weight [h·(d_nope+d_v), d_c] -> W^UK [h, d_nope, d_c], W^UV [h, d_v, d_c]."""
    w = kv_b.reshape(
        cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
    )  # [h, d_nope + d_v, d_c]
    return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]


def query_weight(cfg: MLAConfig, q_weight: np.ndarray) -> np.ndarray:
    """The whole query projection for the naive form, rope rows permuted: [in, h·(d_nope+d_r)]."""
    nope, rope = split_heads(cfg, q_weight)
    w = np.concatenate([nope, rope], axis=1)  # [h, d_nope + d_r, in]
    return w.reshape(-1, w.shape[-1]).T  # [h·(d_nope + d_r), in] -> [in, h·(d_nope + d_r)]


def query_rope_weight(cfg: MLAConfig, q_weight: np.ndarray) -> np.ndarray:
    """Rope rows only, for the absorbed forms: [in, h·d_r]."""
    _, rope = split_heads(cfg, q_weight)
    return rope.reshape(-1, rope.shape[-1]).T  # [h·d_r, in] -> [in, h·d_r]


def query_nope_weight(cfg: MLAConfig, q_weight: np.ndarray) -> np.ndarray:
    """Nope rows only, for the factored form: [in, h·d_nope]."""
    nope, _ = split_heads(cfg, q_weight)
    return nope.reshape(-1, nope.shape[-1]).T  # [h·d_nope, in] -> [in, h·d_nope]


def fused_query_absorb(cfg: MLAConfig, q_weight: np.ndarray, kv_b: np.ndarray) -> np.ndarray:
    """W^QK = W^UKᵀ · W^UQ_nope per head, in float64: [in, h·d_c]."""
    nope, _ = split_heads(cfg, q_weight)
    w_uk, _ = split_kv_b(cfg, kv_b)
    fused = np.einsum("hdc,hdi->hci", w_uk.astype(np.float64), nope.astype(np.float64))  # [h, d_c, in]
    return fused.reshape(-1, fused.shape[-1]).T.astype(q_weight.dtype)  # [h·d_c, in] -> [in, h·d_c]


def fused_output_absorb(cfg: MLAConfig, o_weight: np.ndarray, kv_b: np.ndarray) -> np.ndarray:
    """W^UVO = [W^O_h · W^UV_h]_h in float64: [h·d_c, d]."""
    _, w_uv = split_kv_b(cfg, kv_b)
    w_o = o_weight.reshape(o_weight.shape[0], cfg.num_attention_heads, cfg.v_head_dim)  # [d, h, d_v]
    fused = np.einsum("dhv,hvc->hcd", w_o.astype(np.float64), w_uv.astype(np.float64))  # [h, d_c, d]
    return fused.reshape(-1, fused.shape[-1]).astype(o_weight.dtype)  # [h, d_c, d] -> [h·d_c, d]


def factored_uk(cfg: MLAConfig, kv_b: np.ndarray) -> np.ndarray:
    """[h, d_nope, d_c]: q_nope [h, b, d_nope] @ W^UK -> q_latent [h, b, d_c]."""
    return np.ascontiguousarray(split_kv_b(cfg, kv_b)[0])


def factored_uv(cfg: MLAConfig, kv_b: np.ndarray) -> np.ndarray:
    """[h, d_c, d_v]: o_latent [h, b, d_c] @ W^UVᵀ -> o [h, b, d_v]."""
    return np.ascontiguousarray(split_kv_b(cfg, kv_b)[1].transpose(0, 2, 1))  # [h, d_v, d_c] -> [h, d_c, d_v]


def kv_a_weight(cfg: MLAConfig, w: np.ndarray) -> np.ndarray:
    """kv_a_proj_with_mqa [d_c + d_r, d] with the rope rows permuted: [d, d_c + d_r]."""
    rows = np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + deinterleave_perm(cfg)])
    return w[rows].T


def gate_up_weight(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """SwiGLU gate and up in one matmul: [d, 2·inter] (gate columns first)."""
    return np.concatenate([gate, up], axis=0).T


def gate_up_interleaved(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up [inter, d] -> [d, 2·inter] with columns gate_0, up_0, gate_1, up_1, ...: onnxruntime's fused
    SwiGLU layout (QMoE's swiglu_fusion=1)."""
    return np.stack([gate.T, up.T], axis=2).reshape(gate.shape[1], 2 * gate.shape[0])  # [d, inter, 2] -> [d, 2·inter]


def absorbed_weight_bytes(cfg: MLAConfig, mode: AbsorbMode, itemsize: int = 4) -> int:
    """Attention weight bytes one decode token reads per layer in an absorbed mode (for --absorb auto)."""
    h, dn, dr, dc, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                         cfg.kv_lora_rank, cfg.v_head_dim)
    q_in = cfg.q_lora_rank or cfg.hidden_size
    if mode == AbsorbMode.FUSED:
        elements = q_in * h * dc + h * dc * cfg.hidden_size
    else:
        elements = q_in * h * dn + h * dn * dc + h * dc * dv + h * dv * cfg.hidden_size
    return (elements + q_in * h * dr) * itemsize


def resolve_absorb(cfg: MLAConfig, mode: AbsorbMode | str) -> AbsorbMode:
    """auto -> the absorbed mode with fewer weight bytes (decode is bound by bytes read)."""
    mode = AbsorbMode(mode)
    if mode != AbsorbMode.AUTO:
        return mode
    fused, factored = (absorbed_weight_bytes(cfg, m) for m in (AbsorbMode.FUSED, AbsorbMode.FACTORED))
    return AbsorbMode.FUSED if fused < factored else AbsorbMode.FACTORED
