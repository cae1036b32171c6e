"""The per-layer MLA cache: the latent c_kv after kv_a_layernorm and the roped k_pe. Nothing else."""

from dataclasses import dataclass

import numpy as np
import torch

from ..config import MLAConfig
from ..io_spec import INT8_MAX, CacheFormat

FLT_MIN = float(np.finfo(np.float32).tiny)


def stored_values(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """x [..., width] as a cache in `dtype` holds it, widened back: rounded to a half type, or int8 codes with one
    scale per entry (io_spec.CacheFormat's rule) times that scale."""
    if dtype == "float32":
        return x
    if dtype == "int8":
        scale = torch.clamp(x.abs().amax(-1, keepdim=True) / INT8_MAX, min=FLT_MIN)
        return torch.clamp(torch.round(x / scale), -INT8_MAX, INT8_MAX) * scale
    return x.to(getattr(torch, dtype)).to(x.dtype)


@dataclass
class LayerCache:
    latent: torch.Tensor  # [batch, capacity, kv_lora_rank]
    rope: torch.Tensor  # [batch, capacity, qk_rope_head_dim]
    stored: CacheFormat | None = None  # entries rounded as written: the caches of a half or int8-cache export

    def write(self, latent: torch.Tensor, rope: torch.Tensor, write_indices: torch.Tensor) -> None:
        """Store new entries [b, T, ·] at slots write_indices[b] .. write_indices[b] + T - 1 of each row."""
        if self.stored is not None:
            latent, rope = stored_values(latent, self.stored.latent), stored_values(rope, self.stored.rope)
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
