"""Multi-head Latent Attention in two forms over one cache.

naive:    decompress every cached latent into per-head K and V with kv_b_proj (what training does).
absorbed: fold W^UK into the query and W^UV into the output; attend over the latent itself.

    q_nope_h · k_nope_h(j) = (W^UK_hᵀ q_nope_h) · ĉ_j
    o_h = W^UV_h (Σ_j p_h(t, j) ĉ_j)

Both read and write the same LayerCache: ĉ (after kv_a_layernorm) and k_pe (after RoPE).
Causality is on cache slots: query t of row b sits at slot write_indices[b] + t and sees slot j
when j <= that slot and kv_mask[b, j] is set (kv_mask marks padding holes in the cache).
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import nn

from .. import rope as rope_math
from ..config import MLAConfig
from .cache import LayerCache
from .norm import RMSNorm
from .rope import apply_rope


class AttentionForm(str, Enum):
    NAIVE = "naive"
    ABSORBED = "absorbed"


class MLAttention(nn.Module):
    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=False)
        self.scale = rope_math.softmax_scale(cfg)
        # (W^Q·W^UK [in, h·d_c], W^UV·W^O [h·d_c, d]) given in place of the products the absorbed form computes: a
        # quantized fused export's matrices, for verification (modeling.layerwise)
        self.fused: tuple[torch.Tensor, torch.Tensor] | None = None

    def query_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the query projection to heads reads: x, or c_q = q_norm(W^DQ x) with q LoRA."""
        return x if self.cfg.q_lora_rank is None else self.q_a_layernorm(self.q_a_proj(x))

    def query(self, x: torch.Tensor) -> torch.Tensor:
        q_in = self.query_input(x)
        return self.q_proj(q_in) if self.cfg.q_lora_rank is None else self.q_b_proj(q_in)

    def forward(self, x, cos, sin, perm, cache: LayerCache, write_indices, kv_mask, form: AttentionForm):
        cfg = self.cfg
        b, t, _ = x.shape
        h, dn, dr, dc = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank

        q = self.query(x).view(b, t, h, dn + dr)  # [b, T, h, d_nope + d_r]
        q_nope, q_pe = q.split([dn, dr], dim=-1)  # [b, T, h, d_nope], [b, T, h, d_r]
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([dc, dr], dim=-1)  # [b, T, d_c], [b, T, d_r]
        latent = self.kv_a_layernorm(latent)
        q_pe = apply_rope(q_pe[..., perm], cos[:, :, None, :], sin[:, :, None, :])  # [b, T, h, d_r]
        k_pe = apply_rope(k_pe[..., perm], cos, sin)  # [b, T, d_r]
        cache.write(latent, k_pe, write_indices)

        bias = attention_bias(write_indices, kv_mask, t)  # [b, 1, T, cap]
        rope_scores = torch.einsum("bthr,bsr->bhts", q_pe, cache.rope)
        if form == AttentionForm.NAIVE:
            out = self._naive(q_nope, rope_scores, bias, cache)
        elif self.fused is not None:
            return self._absorbed_given(x, rope_scores, bias, cache)
        else:
            out = self._absorbed(q_nope, rope_scores, bias, cache)
        return self.o_proj(out.reshape(b, t, h * cfg.v_head_dim))  # [b, T, h·d_v] -> [b, T, d]

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(
            cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
        )  # [h, d_nope + d_v, d_c]
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]  # W^UK [h, d_nope, d_c], W^UV [h, d_v, d_c]

    def _naive(self, q_nope, rope_scores, bias, cache):
        cfg = self.cfg
        b, cap, _ = cache.latent.shape
        kv = self.kv_b_proj(cache.latent).view(b, cap, cfg.num_attention_heads, -1)  # [b, cap, h, d_nope + d_v]
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        scores = torch.einsum("bthd,bshd->bhts", q_nope, k_nope) + rope_scores
        probs = torch.softmax(scores * self.scale + bias, dim=-1, dtype=torch.float32).to(q_nope.dtype)
        return torch.einsum("bhts,bshd->bthd", probs, v)  # [b, T, h, d_v]

    def _absorbed(self, q_nope, rope_scores, bias, cache):
        w_uk, w_uv = self._split_kv_b()
        q_latent = torch.einsum("bthd,hdc->bthc", q_nope, w_uk)  # query in latent space [b, T, h, d_c]
        scores = torch.einsum("bthc,bsc->bhts", q_latent, cache.latent) + rope_scores
        probs = torch.softmax(scores * self.scale + bias, dim=-1, dtype=torch.float32).to(q_nope.dtype)
        out_latent = torch.einsum("bhts,bsc->bthc", probs, cache.latent)  # [b, T, h, d_c]
        return torch.einsum("bthc,hvc->bthv", out_latent, w_uv)  # [b, T, h, d_v]


    def _absorbed_given(self, x, rope_scores, bias, cache):
        """The absorbed form on the given fused matrices: q_latent = query_input(x) · W^Q·W^UK, out = o_latent ·
        W^UV·W^O."""
        cfg = self.cfg
        b, t, _ = x.shape
        w_quk, w_uvo = self.fused
        q_latent = (self.query_input(x) @ w_quk).view(
            b, t, cfg.num_attention_heads, cfg.kv_lora_rank
        )  # [b, T, h·d_c] -> [b, T, h, d_c]
        scores = torch.einsum("bthc,bsc->bhts", q_latent, cache.latent) + rope_scores
        probs = torch.softmax(scores * self.scale + bias, dim=-1, dtype=torch.float32).to(x.dtype)
        out_latent = torch.einsum("bhts,bsc->bthc", probs, cache.latent)  # [b, T, h, d_c]
        return out_latent.reshape(b, t, -1) @ w_uvo  # [b, T, h, d_c] -> [b, T, h·d_c] -> [b, T, d]


def attention_bias(write_indices: torch.Tensor, kv_mask: torch.Tensor, t: int) -> torch.Tensor:
    """Additive mask [b, 1, T, cap]: 0 where query t may see slot j, the dtype's minimum elsewhere."""
    cap = kv_mask.shape[1]
    query_slot = write_indices[:, None] + torch.arange(t, device=kv_mask.device)[None, :]  # [b, T]
    visible = torch.arange(cap, device=kv_mask.device)[None, None, :] <= query_slot[:, :, None]  # [b, T, cap]
    visible = visible & kv_mask[:, None, :].bool()
    return torch.where(visible, 0.0, torch.finfo(torch.float32).min)[:, None]  # [b, 1, T, cap]
