"""Feed-forward blocks: dense SwiGLU, and MoE with shared experts and the V2 / V3 routers.

Routers, as transformers implements them:
  V2 (softmax):  s = softmax(W_g x); greedy top-k, or group_limited_greedy (keep the topk_group
                 groups with the highest max score, zero the rest, then top-k); w = s_topk · rsf.
  V3 (sigmoid, noaux_tc): s = σ(W_g x); choose by s + e_score_correction_bias: keep the topk_group
                 groups with the highest sum of their top-2, -inf the rest, top-k; w = s at the chosen
                 experts (the bias only selects), normalized if norm_topk_prob, times rsf.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import MLAConfig


class SwiGLU(nn.Module):
    def __init__(self, d: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> expert indices [N, k], weights [N, k] (float32)."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight.float())  # [N, E]
        if cfg.scoring_func == "sigmoid":
            return self._noaux_tc(logits.sigmoid())
        scores = logits.softmax(dim=-1)
        if cfg.topk_method == "group_limited_greedy":
            group_scores = _grouped(scores, cfg.n_group).max(dim=-1).values  # [N, G]
            scores = scores.masked_fill(~_group_mask(group_scores, cfg), 0.0)
        weights, idx = torch.topk(scores, k=cfg.num_experts_per_tok, dim=-1, sorted=False)
        return idx, weights * cfg.routed_scaling_factor

    def _noaux_tc(self, scores: torch.Tensor):
        cfg = self.cfg
        choice = scores + self.e_score_correction_bias  # [N, E]
        group_scores = _grouped(choice, cfg.n_group).topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        choice = choice.masked_fill(~_group_mask(group_scores, cfg), float("-inf"))
        idx = torch.topk(choice, k=cfg.num_experts_per_tok, dim=-1, sorted=False).indices  # [N, k]
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * cfg.routed_scaling_factor


def _grouped(scores: torch.Tensor, n_group: int) -> torch.Tensor:
    return scores.view(scores.shape[0], n_group, -1)  # [N, E] -> [N, G, E/G]


def _group_mask(group_scores: torch.Tensor, cfg: MLAConfig) -> torch.Tensor:
    """[N, G] group scores -> [N, E] bool: experts in the topk_group best groups."""
    top = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False).indices  # [N, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top, True)  # [N, G]
    per_group = cfg.n_routed_experts // cfg.n_group
    return keep[:, :, None].expand(-1, -1, per_group).reshape(group_scores.shape[0], -1)  # [N, E]


class MoE(nn.Module):
    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, d]
        idx, weights = self.gate(flat)
        out = torch.zeros_like(flat)
        for e in torch.unique(idx).tolist():  # only the experts some token chose
            rows, slot = torch.where(idx == e)
            y = self.experts[e](flat[rows]) * weights[rows, slot, None].to(flat.dtype)
            out.index_add_(0, rows, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)  # [N, d] -> [b, T, d]
