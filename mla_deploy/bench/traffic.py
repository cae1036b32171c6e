"""Bytes a decode step must read: the weights it actually uses plus the cache. Derived from the config."""

from __future__ import annotations

from ..config import MLAConfig
from ..export.absorb import AbsorbMode, absorbed_weight_bytes

F32 = 4


def decode_weight_bytes(cfg: MLAConfig, absorb: AbsorbMode | None, active_experts: int) -> int:
    """Weights read per decode step: attention (absorbed in `absorb`, or decompressing when None), MLPs,
    `active_experts` routed experts per MoE layer, routers, norms, lm_head (the embedding row is negligible)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    total = cfg.vocab_size * d * F32  # lm_head
    for layer in range(cfg.num_hidden_layers):
        q_in = cfg.q_lora_rank or d
        attn = (d * q_in if cfg.q_lora_rank else 0) + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        attn *= F32
        if absorb is None:  # naive: full query, kv_b, o_proj
            attn += (q_in * h * cfg.qk_head_dim + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                     + h * cfg.v_head_dim * d) * F32
        else:
            attn += absorbed_weight_bytes(cfg, absorb, F32)
        total += attn
        if cfg.is_moe_layer(layer):
            expert = 3 * d * cfg.moe_intermediate_size * F32
            total += expert * (active_experts + cfg.n_shared_experts) + cfg.n_routed_experts * d * F32
        else:
            total += 3 * d * cfg.intermediate_size * F32
    return total


def latent_cache_bytes_per_token(cfg: MLAConfig) -> int:
    return cfg.num_hidden_layers * cfg.latent_cache_width * F32


def mha_cache_bytes_per_token(cfg: MLAConfig) -> int:
    return cfg.num_hidden_layers * cfg.mha_cache_width * F32
