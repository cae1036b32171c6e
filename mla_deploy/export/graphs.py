"""The two graphs: prefill (any number of new tokens, naive attention) and decode (one token, absorbed)."""

from __future__ import annotations

import numpy as np

from .. import io_spec
from ..config import MLAConfig
from . import layers
from .absorb import AbsorbMode
from .onnx_builder import GraphBuilder


def build_graph(kind: str, cfg: MLAConfig, t: layers.Tensors, max_seq_len: int, absorb: AbsorbMode,
                weights: dict[str, np.ndarray]) -> GraphBuilder:
    """prefill or decode over the io_spec contract; `weights` collects the initializers both graphs share."""
    g = GraphBuilder(kind, weights)
    inputs, outputs = io_spec.graph_io(kind, cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.vocab_size)
    for spec in inputs:
        g.input(spec.name, spec.dtype, spec.shape)
    input_ids, position_ids = io_spec.INPUT_IDS, io_spec.POSITION_IDS
    write_indices, attention_mask = io_spec.WRITE_INDICES, io_spec.ATTENTION_MASK

    x = g.Gather(g.weight("embed", t("model.embed_tokens.weight")), input_ids, axis=0)  # [b, T, d]
    cos, sin = layers.rope_lookup(g, cfg, position_ids, max_seq_len)  # [b, T, d_r/2]
    bias = layers.attention_bias(g, input_ids, attention_mask, write_indices)  # [b, 1, T, cap]
    presents = {}
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        attn = layers.AttentionBuilder(g, cfg, t, i)
        h = layers.rms_norm(g, x, f"layers.{i}.input_norm", t(hf + "input_layernorm.weight"), cfg.rms_norm_eps)
        cache = (io_spec.past_latent(i), io_spec.past_rope(i), write_indices)
        if kind == io_spec.PREFILL:
            a, latent, rope = attn.naive(h, cos, sin, bias, *cache)
        else:
            a, latent, rope = attn.absorbed(h, cos, sin, bias, *cache, mode=absorb)
        presents[io_spec.present_latent(i)], presents[io_spec.present_rope(i)] = latent, rope
        x = g.Add(x, a)
        h = layers.rms_norm(g, x, f"layers.{i}.post_norm", t(hf + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        if cfg.is_moe_layer(i):
            x = g.Add(x, layers.moe(g, cfg, h, t, i))
        else:
            x = g.Add(x, layers.hf_swiglu(g, h, f"layers.{i}.mlp", t, hf + "mlp."))

    if kind == io_spec.PREFILL:  # only the asked-for positions reach the (large) vocabulary projection
        index = g.Expand(g.Unsqueeze(io_spec.LOGITS_POSITIONS, g.const([-1])), g.const([1, 1, cfg.hidden_size]))
        x = g.GatherElements(x, index, axis=1)  # [b, n, d]
    x = layers.rms_norm(g, x, "final_norm", t("model.norm.weight"), cfg.rms_norm_eps)
    head = t("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    logits = layers.linear(g, x, "lm_head", head.T)  # [b, n, vocab]
    for spec in outputs:
        g.output(logits if spec.name == io_spec.LOGITS else presents[spec.name], spec.name, spec.dtype, spec.shape)
    return g
