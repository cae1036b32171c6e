"""What a model costs, from its config alone: parameters (total and active per token), the weight bytes one
decode step reads by group, and cache bytes per token for MLA in every cache format beside the caches of the same
heads as MHA, GQA and MQA. Torch-free; `inspect` prints it and the benchmarks use it for bytes per token.
"""

from __future__ import annotations

from .checkpoint import parameter_count
from .config import MLAConfig
from .export.absorb import AbsorbMode, absorbed_weight_bytes
from .io_spec import ITEMSIZE, CacheFormat

F32 = 4
CONTEXTS = (4096, 32768, 131072)
BATCHES = (1, 8)


def parameter_counts(cfg: MLAConfig) -> dict[str, int]:
    """total: every weight; active: the weights multiplied for one token (the embedding row is a lookup, and
    only num_experts_per_tok of each MoE layer's routed experts run), as DeepSeek counts "activated" parameters."""
    total = parameter_count(cfg)
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    idle = sum(
        cfg.n_routed_experts - cfg.num_experts_per_tok for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)
    )
    embedding = cfg.vocab_size * cfg.hidden_size
    lookup_only = 0 if cfg.tie_word_embeddings else embedding  # a tied table is also the head's matmul
    return {"total": total, "active_per_token": total - lookup_only - idle * expert, "embedding": embedding}


def decode_read_bytes(cfg: MLAConfig, absorb: AbsorbMode | None, itemsize: float = F32,
                      active_experts: int | None = None, quantized_itemsize: float | None = None,
                      head_itemsize: float | None = None, per_head_itemsize: float = F32) -> dict[str, int]:
    """Weight bytes one decode token reads, by group: attention in the absorbed form `absorb` (None: the naive form,
    decompressing the cache), `active_experts` routed experts per MoE layer (default: num_experts_per_tok).
    `quantized_itemsize`: bytes per weight of what a quantized export stores as codes (export.quantize: every
    linear weight but kv_b and the routers; the head at `head_itemsize`); the rest stays at `itemsize`. The factored
    form's per-head W^UK / W^UV are float32 islands, or codes at `per_head_itemsize` in a quantized export."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    dn, dr, dc, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
    k = cfg.num_experts_per_tok if active_experts is None else active_experts
    q_size = itemsize if quantized_itemsize is None else quantized_itemsize
    q_in = cfg.q_lora_rank or d
    groups = dict.fromkeys(
        ("lm_head", "attention", "dense_mlp", "shared_experts", "routed_experts", "routers_and_norms"), 0.0
    )
    groups["lm_head"] = cfg.vocab_size * d * (q_size if head_itemsize is None else head_itemsize)
    groups["routers_and_norms"] = d * itemsize  # the final norm
    for layer in range(cfg.num_hidden_layers):
        projections = (
            (d * q_in if cfg.q_lora_rank else 0) + d * (dc + dr) + q_in * h * (dn + dr) + h * dv * d
        )  # q_a, kv_a, q, o
        if absorb is None:  # naive: kv_b decompresses the cache
            from_kv_b = dc * h * (dn + dv)
        elif absorb == AbsorbMode.FACTORED:  # per-head W^UK, W^UV: float32, or codes (counted in their bytes)
            from_kv_b = (h * dn * dc + h * dc * dv) * per_head_itemsize / itemsize
        else:  # fused products replace q's nope rows and o (quantized after absorption when the export quantizes)
            fused = absorbed_weight_bytes(cfg, absorb, 1) - q_in * h * dr
            from_kv_b, projections = 0, projections - q_in * h * dn - h * dv * d + fused
        groups["attention"] += projections * q_size + from_kv_b * itemsize
        norms = 2 * d + dc + (cfg.q_lora_rank or 0)
        if cfg.is_moe_layer(layer):
            expert = 3 * d * cfg.moe_intermediate_size * q_size
            groups["routed_experts"] += k * expert
            groups["shared_experts"] += cfg.n_shared_experts * expert
            norms += cfg.n_routed_experts * d  # the router
        else:
            groups["dense_mlp"] += 3 * d * cfg.intermediate_size * q_size
        groups["routers_and_norms"] += norms * itemsize
    return {name: round(n) for name, n in groups.items()}


# MLA's cache formats (export --cache-dtype), by the name inspect gives them; half types take the same bytes
MLA_CACHES = {
    "MLA float32": CacheFormat("float32", "float32"),
    "MLA float16 / bfloat16": CacheFormat("float16", "float16"),
    "MLA int8 + float32 rope": CacheFormat("int8", "float32"),
    "MLA int8 + 16-bit rope": CacheFormat("int8", "float16"),
}


def cache_name(cache: CacheFormat | str) -> str:
    """The MLA_CACHES name of a cache format: the row of an export's own caches."""
    cache = CacheFormat.of(cache)
    if cache.scaled:
        return f"MLA int8 + {'float32' if cache.rope == 'float32' else '16-bit'} rope"
    return "MLA float32" if cache.latent == "float32" else "MLA float16 / bfloat16"


def cache_bytes_per_token(cfg: MLAConfig, float_type: str = "float32") -> dict[str, int]:
    """Bytes cached per token over all layers: MLA's latent + roped key in every cache format (MLA_CACHES: an int8
    latent's scale included), and K/V caches of the same head dims (K: d_nope + d_r, V: d_v) in `float_type` with
    every head (MHA), 8 or 4 KV heads (GQA) or one (MQA)."""
    layers, per_head = cfg.num_hidden_layers, cfg.qk_head_dim + cfg.v_head_dim
    out = {name: f.bytes_per_token(layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim) for name, f in MLA_CACHES.items()}
    label = "float32" if ITEMSIZE[float_type] == F32 else "16-bit"
    kinds = {f"MHA ({cfg.num_attention_heads} KV heads), {label}": cfg.num_attention_heads * per_head}
    for groups in (8, 4):
        if groups < cfg.num_attention_heads:
            kinds[f"GQA ({groups} KV heads), {label}"] = groups * per_head
    kinds[f"MQA (1 KV head), {label}"] = per_head
    return {**out, **{name: layers * width * ITEMSIZE[float_type] for name, width in kinds.items()}}


def latent_cache_bytes_per_token(cfg: MLAConfig, itemsize: int = F32) -> int:
    return cfg.num_hidden_layers * cfg.latent_cache_width * itemsize


def mha_cache_bytes_per_token(cfg: MLAConfig, itemsize: int = F32) -> int:
    return cfg.num_hidden_layers * cfg.mha_cache_width * itemsize
