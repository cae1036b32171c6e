"""The torch source run one decoder layer at a time: verification of checkpoints larger than memory.

Every token of a request goes through layer i before layer i + 1 is read: the prompts in one
naive-attention pass, then each decode token in the absorbed form, one step at a time, against the
layer's own cache. Each layer's weights are read from the checkpoint once, used for every position and
step, and dropped, so memory holds one layer, the embeddings or the head, the hidden states
[b, T + steps, d] and one layer's cache. The decode tokens must be known before the first layer runs:
verification feeds the tokens the export generated and checks that the source would have chosen them.
The arithmetic is MLAForCausalLM's, module for module (the same DecoderLayer, RMSNorm and head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checkpoint import Checkpoint
from ..io_spec import CacheFormat
from .attention import AttentionForm
from .cache import LayerCache
from .model import DecoderLayer
from .norm import RMSNorm
from .rope import RopeTables


def _weights(ckpt: Checkpoint, prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix):]: torch.from_numpy(ckpt.tensor(name)) for name in ckpt.names() if name.startswith(prefix)}


def _layer(ckpt: Checkpoint, i: int) -> DecoderLayer:
    with torch.device("meta"):
        layer = DecoderLayer(ckpt.config, i)
    layer.load_state_dict(_weights(ckpt, f"model.layers.{i}."), strict=True, assign=True)
    fused = getattr(ckpt, "absorbed_matrices", lambda i: None)(i)  # a quantized fused export's (DequantizedCheckpoint)
    if fused is not None:
        layer.self_attn.fused = tuple(torch.from_numpy(w) for w in fused)
    return layer.eval().requires_grad_(False)


@torch.no_grad()
def layerwise_logits(
    ckpt: Checkpoint,
    ids: torch.Tensor,
    kv_mask: torch.Tensor,
    lengths: torch.Tensor,
    decode_tokens: torch.Tensor,
    stored: CacheFormat | None = None,
    prefill_form: AttentionForm = AttentionForm.NAIVE,
    hidden: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Prefill logits [b, T, vocab] of right-padded prompts `ids` [b, T] (`lengths` [b] real tokens each), then the
    logits [b, steps, vocab] of decoding `decode_tokens` [b, steps] one at a time at slots lengths + step.
    `kv_mask` [b, capacity >= T + steps] as the graphs take it. `ckpt` may be any reader with `config`, `names()`
    and `tensor(name)`: verification of a quantized export passes export.quantize.DequantizedCheckpoint. `stored`:
    cache entries rounded to that format as written, as a half-precision or int8-cache export's caches hold them.
    `prefill_form`: the prompts' attention form, as the export's prefill graph runs it (export.plan's prefill
    attention: absorbed over an int8 cache, whose quantized fused matrices differ from the naive form's factors).
    `hidden`: the final hidden states (after the final norm) [b, T, d] and [b, steps, d] follow the logits."""
    cfg = ckpt.config
    b, t = ids.shape
    steps = decode_tokens.shape[1]
    rope = RopeTables(cfg)
    prompt_pos = torch.arange(t).expand(b, t)  # [b, T]
    step_pos = lengths[:, None] + torch.arange(steps)[None, :]  # [b, steps]: each decode token's slot and position
    embed = torch.from_numpy(ckpt.tensor("model.embed_tokens.weight"))
    prompt, decoded = embed[ids], embed[decode_tokens]  # [b, T, d], [b, steps, d]
    del embed
    cos_p, sin_p = rope.lookup(prompt_pos)
    cos_s, sin_s = rope.lookup(step_pos)
    for i in range(cfg.num_hidden_layers):
        layer = _layer(ckpt, i)
        cache = LayerCache(torch.zeros(b, kv_mask.shape[1], cfg.kv_lora_rank),
                           torch.zeros(b, kv_mask.shape[1], cfg.qk_rope_head_dim), stored)
        prompt = layer(prompt, cos_p, sin_p, rope.perm, cache, torch.zeros(b, dtype=torch.long), kv_mask, prefill_form)
        for s in range(steps):
            decoded[:, s : s + 1] = layer(decoded[:, s : s + 1], cos_s[:, s : s + 1], sin_s[:, s : s + 1], rope.perm,
                                          cache, step_pos[:, s], kv_mask, AttentionForm.ABSORBED)
        del layer, cache
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.load_state_dict(_weights(ckpt, "model.norm."))
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head = torch.from_numpy(ckpt.tensor(head_name))  # [vocab, d]
    prompt, decoded = norm(prompt), norm(decoded)
    logits = F.linear(prompt, head).float(), F.linear(decoded, head).float()
    return (*logits, prompt.float(), decoded.float()) if hidden else logits
