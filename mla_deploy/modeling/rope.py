"""Rotate-half RoPE on de-interleaved rope dims (see mla_deploy.rope for the layout and the tables)."""

import torch

from .. import rope as rope_math
from ..config import MLAConfig


class RopeTables(torch.nn.Module):
    """cos/sin per position (YaRN attention factor folded in) and the de-interleave permutation."""

    def __init__(self, cfg: MLAConfig):
        super().__init__()
        cos, sin = rope_math.rope_tables(cfg, cfg.max_position_embeddings)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)  # [max_pos, d_r/2]
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)  # [max_pos, d_r/2]
        self.register_buffer("perm", torch.from_numpy(rope_math.deinterleave_perm(cfg)), persistent=False)

    def lookup(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, T] -> cos, sin [b, T, d_r/2]."""
        return self.cos[position_ids], self.sin[position_ids]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d_r] in rotate-half layout; cos/sin broadcast to [..., d_r/2]."""
    x1, x2 = x.chunk(2, dim=-1)  # [..., d_r/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
