"""DeepSeek-V3's multi-token-prediction (MTP) module, the draft of speculative decoding.

Stored as the checkpoint's layer L = num_hidden_layers (DeepSeek-V3's README_WEIGHTS.md): a decoder layer of the
model's own shape (MoE where layer L is one, as in V3), plus `enorm`, `hnorm`, `eh_proj` [d, 2d] and
`shared_head.norm`; it shares the main model's embedding and output layer. At position i it reads the main model's
final hidden state h_i and the next token t_{i+1}:

    h'_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])          the embedding first, then the hidden state
    logits_i = head(shared_head.norm(layer_L(h'_i)))             predicting t_{i+2}

The concat order and the hidden state are those of vLLM's DeepSeekMultiTokenPredictorLayer and SGLang's
DeepseekModelNextN: torch.cat([enorm(embeds), hnorm(previous_hidden)]), previous_hidden being what the main model
returns, after its final norm (the DeepSeek-V3 report writes the concatenation the other way round; the weights
follow the code). Layer L runs at position i over its own latent cache. Chained for a second draft token, the
module reads its own normed hidden state (what its head read) in place of h: the analogue of the main model's.
vLLM also zeroes the embedding at position 0; SGLang and training do not, nor does this module.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import MLAConfig
from .attention import AttentionForm
from .cache import LayerCache
from .model import DecoderLayer
from .norm import RMSNorm
from .rope import RopeTables


class SharedHead(nn.Module):
    def __init__(self, cfg: MLAConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """Layer num_hidden_layers of a V3 checkpoint, its parameters named as stored there."""

    def __init__(self, cfg: MLAConfig):
        super().__init__(cfg, cfg.num_hidden_layers)
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(cfg)

    def draft(self, embeds, hidden, cos, sin, perm, cache: LayerCache, write_indices, kv_mask, form) -> torch.Tensor:
        """embeds [b, T, d] of tokens i + 1, hidden [b, T, d] at i -> the normed state the head reads [b, T, d]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm(super().forward(x, cos, sin, perm, cache, write_indices, kv_mask, form))


class MTPDraft(nn.Module):
    """The MTP layer over the main model's embedding, rope tables and output layer (given as modules: a draft does
    not need the main layers in memory)."""

    def __init__(self, layer: MTPLayer, embed_tokens: nn.Embedding, lm_head: nn.Linear, rope: RopeTables):
        super().__init__()
        self.layer, self.embed_tokens, self.lm_head, self.rope = layer, embed_tokens, lm_head, rope

    @torch.no_grad()
    def forward(self, input_ids, previous_hidden, position_ids, cache: LayerCache, write_indices, kv_mask,
                form: AttentionForm = AttentionForm.ABSORBED) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [b, T]: tokens i + 1; previous_hidden [b, T, d]: the main model's hidden state at i (or the
        draft's own, chained); position_ids [b, T]: i. Returns logits [b, T, vocab] (float32) predicting the tokens
        i + 2, and the normed hidden state [b, T, d]; the cache updated in place."""
        cos, sin = self.rope.lookup(position_ids)
        hidden = self.layer.draft(self.embed_tokens(input_ids), previous_hidden.to(self.lm_head.weight.dtype),
                                  cos, sin, self.rope.perm, cache, write_indices, kv_mask, AttentionForm(form))
        return self.lm_head(hidden).float(), hidden
