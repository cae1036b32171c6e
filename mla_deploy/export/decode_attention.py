"""How the decode graph runs its attention core (softmax(q · cache) @ latent), chosen from the config and the
caches' dtype (each choice measured: README, Serving); the export's length picks the function body (long_cache).

- "kernel": mla_deploy.LatentAttention (LatentAttentionF16 / BF16 for half caches; mla_deploy.kernels): scores,
  softmax and probs @ latent in one op that reads the caches as stored and skips slots the row does not see, so a
  step reads each row's cache up to its own length. Its function body, where the kernel library is not registered,
  is the "ops" form (LatentAttentionLong*: the long-cache form, the cache as the A operand).
- "ops": onnxruntime's MatMul, Softmax and MatMul (export.layers.MLAttention._probs_at_latent), the cache as the B
  operand, or the A operand where a row's cache can outgrow LONG_CACHE_BYTES (MLAS packs B on every call).

auto: "kernel" where its widths fit the kernel's blocks (d_c a multiple of 16, d_r of 8), for half caches always and
for float32 caches below 16 heads; else "ops". Measured against its own function body (the "ops" form):
- float32 caches: the heads decide, as onnxruntime's MatMuls multiply the scores as [cap, d_c] @ [d_c, h] in
  16-column panels. One thread, 16 rows x 200 of 256 slots seen: 4 heads of the demo's widths (64 + 16) 2-3x faster,
  4 heads of DeepSeek's (512 + 64) 1.9x, 8 heads (128 + 32) 1.2x, 16 heads 0.8x (one row, 4096 slots: 2.8 vs 2.0 ms).
- half caches: the ops cast the whole cache to float32 in every layer of every step; the kernel widens what it
  reads. 16 heads of DeepSeek's widths, 2 threads: one row at 4096 slots 1.21 vs 2.15 ms (float16), 1.35 vs 3.64
  (bfloat16); at 16384 slots 5.3 vs 9.7 ms (float16); 8 rows x 3000 of 4096 slots 7.4 vs 17.0 ms (float16).
"""

from __future__ import annotations

from ..config import MLAConfig
from ..errors import ExportError

CHOICES = ("auto", "kernel", "ops")
KERNEL_HEADS_BELOW = 16  # auto picks the kernel over float32 caches for fewer heads than this


def long_cache(cfg: MLAConfig, max_seq_len: int, limit_bytes: int) -> bool:
    """Whether a row's float32 latent cache at the export's full length outgrows `limit_bytes`."""
    return max_seq_len * cfg.kv_lora_rank * 4 > limit_bytes


def kernel_fits(cfg: MLAConfig) -> bool:
    return cfg.kv_lora_rank % 16 == 0 and cfg.qk_rope_head_dim % 8 == 0


def resolve_decode_attention(cfg: MLAConfig, requested: str, cache_dtype: str = "float32") -> str:
    """What the decode graph runs, as the manifest records it (`cache_dtype`: the export's)."""
    if requested not in CHOICES:
        raise ExportError(f"decode_attention={requested!r}: expected one of {', '.join(CHOICES)}")
    if requested == "kernel" and not kernel_fits(cfg):
        raise ExportError(f"decode_attention='kernel' needs kv_lora_rank a multiple of 16 and qk_rope_head_dim of 8 "
                          f"(this config: {cfg.kv_lora_rank} and {cfg.qk_rope_head_dim}); use 'ops'")
    if requested != "auto":
        return requested
    few_heads = cfg.num_attention_heads < KERNEL_HEADS_BELOW
    return "kernel" if kernel_fits(cfg) and (few_heads or cache_dtype != "float32") else "ops"
