"""How the decode graph runs its attention core (softmax(q · cache) @ latent), chosen from the config and the
export's length (each choice measured: README, Serving).

- "kernel": mla_deploy.LatentAttention (LatentAttentionF16 / BF16 for half caches; mla_deploy.kernels): scores,
  softmax and probs @ latent in one op that reads the caches as stored and skips slots the row does not see, so a
  step reads each row's cache up to its own length. Its function body, where the kernel library is not registered,
  is the "ops" form with the cache as MatMul's B operand.
- "ops": onnxruntime's MatMul, Softmax and MatMul (export.layers.MLAttention._probs_at_latent), the cache as the B
  operand, or the A operand where a row's cache can outgrow LONG_CACHE_BYTES (MLAS packs B on every call).

auto: "kernel" for models with fewer than 16 heads whose cache stays short (the kernel's function body would pack a
long cache as B on every step) and whose widths fit the kernel's blocks (d_c a multiple of 16, d_r of 8); else "ops".
The heads decide because onnxruntime's MatMuls multiply the scores as [cap, d_c] @ [d_c, h] in 16-column panels:
one thread, 16 rows x 200 of 256 slots seen, the kernel against its own function body (the "ops" form): 4 heads of
the demo's widths (64 + 16) 2-3x faster, 4 heads of DeepSeek's (512 + 64) 1.9x, 8 heads (128 + 32) 1.2x, 16 heads
0.8x (16 heads of 512 + 64 at 4096 slots, one row: 2.8 vs 2.0 ms).
"""

from __future__ import annotations

from ..config import MLAConfig
from ..errors import ExportError

CHOICES = ("auto", "kernel", "ops")
KERNEL_HEADS_BELOW = 16  # auto picks the kernel for fewer heads than this


def long_cache(cfg: MLAConfig, max_seq_len: int, limit_bytes: int) -> bool:
    """Whether a row's float32 latent cache at the export's full length outgrows `limit_bytes`."""
    return max_seq_len * cfg.kv_lora_rank * 4 > limit_bytes


def kernel_fits(cfg: MLAConfig) -> bool:
    return cfg.kv_lora_rank % 16 == 0 and cfg.qk_rope_head_dim % 8 == 0


def resolve_decode_attention(cfg: MLAConfig, requested: str, long: bool) -> str:
    """What the decode graph runs, as the manifest records it (`long`: long_cache)."""
    if requested not in CHOICES:
        raise ExportError(f"decode_attention={requested!r}: expected one of {', '.join(CHOICES)}")
    if requested == "kernel" and not kernel_fits(cfg):
        raise ExportError(f"decode_attention='kernel' needs kv_lora_rank a multiple of 16 and qk_rope_head_dim of 8 "
                          f"(this config: {cfg.kv_lora_rank} and {cfg.qk_rope_head_dim}); use 'ops'")
    if requested != "auto":
        return requested
    return "kernel" if kernel_fits(cfg) and not long and cfg.num_attention_heads < KERNEL_HEADS_BELOW else "ops"
