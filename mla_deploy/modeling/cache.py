"""The per-layer MLA cache: the latent c_kv after kv_a_layernorm and the roped k_pe. Nothing else."""

from dataclasses import dataclass

import torch

from ..config import MLAConfig


@dataclass
class LayerCache:
    latent: torch.Tensor  # [batch, capacity, kv_lora_rank]
    rope: torch.Tensor  # [batch, capacity, qk_rope_head_dim]
    stored: torch.dtype | None = None  # entries rounded to this dtype as written: the caches of a half-precision export

    def write(self, latent: torch.Tensor, rope: torch.Tensor, write_indices: torch.Tensor) -> None:
        """Store new entries [b, T, ·] at slots write_indices[b] .. write_indices[b] + T - 1 of each row."""
        if self.stored is not None:
            latent, rope = latent.to(self.stored).to(latent.dtype), rope.to(self.stored).to(rope.dtype)
        b, t = latent.shape[:2]
        slots = write_indices[:, None] + torch.arange(t, device=latent.device)[None, :]  # [b, T]
        self.latent.scatter_(1, slots[..., None].expand(b, t, latent.shape[-1]), latent)
        self.rope.scatter_(1, slots[..., None].expand(b, t, rope.shape[-1]), rope)


def new_caches(cfg: MLAConfig, batch: int, capacity: int, dtype=torch.float32) -> list[LayerCache]:
    return [
        LayerCache(torch.zeros(batch, capacity, cfg.kv_lora_rank, dtype=dtype),
                   torch.zeros(batch, capacity, cfg.qk_rope_head_dim, dtype=dtype))
        for _ in range(cfg.num_hidden_layers)
    ]
