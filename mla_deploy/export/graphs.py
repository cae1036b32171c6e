"""The two graphs: prefill (any number of new tokens, naive attention) and decode (one token, absorbed).

`decoder` is the stack every graph shares (embedding, per-layer norm / attention / MLP or MoE with
residuals, final norm, vocabulary projection); a graph only chooses the attention of each layer.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import io_spec
from ..config import MLAConfig
from . import layers
from .absorb import AbsorbMode
from .onnx_builder import GraphBuilder

# (layer attention builder, normed hidden [b, T, d], cos, sin) -> attention output [b, T, d]
AttentionFn = Callable[[layers.AttentionBuilder, str, str, str], str]


def decoder(g: GraphBuilder, cfg: MLAConfig, t: layers.Tensors, max_seq_len: int, attention: AttentionFn,
            logits_positions: str | None = None) -> str:
    """input_ids, position_ids -> logits [b, n, vocab]."""
    x = g.Gather(g.weight("embed", t("model.embed_tokens.weight")), io_spec.INPUT_IDS, axis=0)  # [b, T, d]
    cos, sin = layers.rope_lookup(g, cfg, io_spec.POSITION_IDS, max_seq_len)  # [b, T, d_r/2]
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        h = layers.rms_norm(g, x, f"layers.{i}.input_norm", t(hf + "input_layernorm.weight"), cfg.rms_norm_eps)
        x = g.Add(x, attention(layers.AttentionBuilder(g, cfg, t, i), h, cos, sin))
        h = layers.rms_norm(g, x, f"layers.{i}.post_norm", t(hf + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        mlp = layers.moe(g, cfg, h, t, i) if cfg.is_moe_layer(i) else layers.hf_swiglu(g, h, f"layers.{i}.mlp", t, hf + "mlp.")
        x = g.Add(x, mlp)
    if logits_positions is not None:  # only the asked-for positions reach the (large) vocabulary projection
        index = g.Expand(g.Unsqueeze(logits_positions, g.const([-1])), g.const([1, 1, cfg.hidden_size]))
        x = g.GatherElements(x, index, axis=1)  # [b, n, d]
    x = layers.rms_norm(g, x, "final_norm", t("model.norm.weight"), cfg.rms_norm_eps)
    head = t("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    return layers.linear(g, x, "lm_head", head.T)  # [b, n, vocab]


def build_graph(kind: str, cfg: MLAConfig, t: layers.Tensors, max_seq_len: int, absorb: AbsorbMode,
                weights: dict[str, np.ndarray]) -> GraphBuilder:
    """prefill or decode over the io_spec contract; `weights` collects the initializers both graphs share."""
    g = GraphBuilder(kind, weights)
    inputs, outputs = io_spec.graph_io(kind, cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.vocab_size)
    for spec in inputs:
        g.input(spec.name, spec.dtype, spec.shape)
    write_indices = io_spec.WRITE_INDICES
    bias = layers.attention_bias(g, io_spec.INPUT_IDS, io_spec.ATTENTION_MASK, write_indices)  # [b, 1, T, cap]

    def attention(attn: layers.AttentionBuilder, h: str, cos: str, sin: str) -> str:
        cache = (io_spec.past_latent(attn.layer), io_spec.past_rope(attn.layer), write_indices)
        if kind == io_spec.PREFILL:
            out, _, _ = attn.naive(h, cos, sin, bias, *cache)
        else:
            out, _, _ = attn.absorbed(h, cos, sin, bias, *cache, mode=absorb)
        return out  # the caches are written straight to present_latent.{i} / present_rope.{i}

    logits = decoder(g, cfg, t, max_seq_len, attention,
                     io_spec.LOGITS_POSITIONS if kind == io_spec.PREFILL else None)
    for spec in outputs:
        g.output(logits if spec.name == io_spec.LOGITS else spec.name, spec.name, spec.dtype, spec.shape)
    return g
