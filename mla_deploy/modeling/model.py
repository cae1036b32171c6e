"""The decoder stack, with HF parameter names so a checkpoint's state dict loads as is."""

from __future__ import annotations

import torch
from torch import nn

from ..config import MLAConfig
from .attention import AttentionForm, MLAttention
from .cache import LayerCache
from .moe import MoE, SwiGLU
from .norm import RMSNorm
from .rope import RopeTables


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MLAConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, perm, cache, write_indices, kv_mask, form):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, perm, cache, write_indices, kv_mask, form)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MLAForCausalLM(nn.Module):
    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RopeTables(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [b, T]
        position_ids: torch.Tensor,  # [b, T]
        caches: list[LayerCache],  # per layer, capacity >= write_indices + T
        write_indices: torch.Tensor,  # [b]: cache slot of each row's first new token
        kv_mask: torch.Tensor,  # [b, cap]: 1 where a slot holds a real token
        form: AttentionForm = AttentionForm.ABSORBED,
        logits_positions: torch.Tensor | None = None,  # [b, n] chunk positions to score; all when None
    ) -> torch.Tensor:
        """Logits [b, T or n, vocab]; the caches are updated in place."""
        return self.logits_and_hidden(input_ids, position_ids, caches, write_indices, kv_mask, form, logits_positions)[0]

    @torch.no_grad()
    def logits_and_hidden(self, input_ids, position_ids, caches, write_indices, kv_mask,
                          form: AttentionForm = AttentionForm.ABSORBED,
                          logits_positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's logits, and the final hidden state [b, T, d] at every position (after the final norm: what the
        head reads, and what the MTP draft reads)."""
        form = AttentionForm(form)
        cos, sin = self.rope.lookup(position_ids)
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, cos, sin, self.rope.perm, cache, write_indices, kv_mask, form)
        hidden = self.model.norm(x)
        x = hidden
        if logits_positions is not None:
            x = torch.gather(x, 1, logits_positions[..., None].expand(-1, -1, x.shape[-1]))  # [b, n, d]
        return self.lm_head(x).float(), hidden
