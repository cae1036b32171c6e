"""modeling/model.py as graph code: the decoder stack every graph shares (embedding, per-layer norm / attention /
MLP or MoE with residuals, final norm, vocabulary projection); a graph only chooses the attention of each layer."""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from .. import io_spec
from ..config import MLAConfig
from .attention import MLAttention
from .builder import Graph, Tensors
from .linear import embedding, linear
from .moe import MoE, SwiGLU
from .norm import RMSNorm
from .rope import rope_lookup

# (op, layer attention, normed hidden [b, T, d], cos, sin) -> attention output [b, T, d]
AttentionFn = Callable[..., ir.Value]


def decoder(g: Graph, cfg: MLAConfig, t: Tensors, inputs: dict[str, ir.Value], attention: AttentionFn,
            logits_positions: ir.Value | None = None,
            on_layer: Callable[[int], None] = lambda i: None) -> tuple[ir.Value, ir.Value]:
    """input_ids, position_ids -> logits [b, n, vocab] (at logits_positions; all positions where None) and the final
    hidden state [b, T, d] float32 at every position (after the final norm: what the head reads); on_layer(i) after
    each layer (weights written)."""
    op, eps = g.op, cfg.rms_norm_eps
    x = embedding(g, inputs[io_spec.INPUT_IDS], lambda: t("model.embed_tokens.weight"))  # [b, T, d]
    cos, sin = rope_lookup(g, cfg, inputs[io_spec.POSITION_IDS])  # [b, T, d_r/2]
    for i in range(cfg.num_hidden_layers):
        x = decoder_layer(g, cfg, t, i, x, cos, sin, attention)
        on_layer(i)
    hidden = RMSNorm(g, "final_norm", "model.norm.weight", t, eps)(op, x)  # [b, T, d]
    return vocabulary(g, cfg, t, gather_positions(g, cfg, hidden, logits_positions)), g.to_float(op, hidden)


def decoder_layer(g: Graph, cfg: MLAConfig, t: Tensors, i: int, x: ir.Value, cos: ir.Value, sin: ir.Value,
                  attention: AttentionFn) -> ir.Value:
    """modeling.model.DecoderLayer: layer i (HF weights model.layers.{i}.*) with the graph's attention."""
    op, eps, hf = g.op, cfg.rms_norm_eps, f"model.layers.{i}."
    with g.scope(f"layers.{i}"):
        h = RMSNorm(g, f"layers.{i}.input_norm", hf + "input_layernorm.weight", t, eps)(op, x)
        with g.scope("attn"):
            x = op.Add(x, attention(op, MLAttention(g, cfg, t, i), h, cos, sin))
        h = RMSNorm(g, f"layers.{i}.post_norm", hf + "post_attention_layernorm.weight", t, eps)(op, x)
        with g.scope("mlp"):
            mlp = (MoE(g, cfg, t, i) if cfg.is_moe_layer(i)
                   else SwiGLU(g, f"layers.{i}.mlp", hf + "mlp.", t, cfg.intermediate_size))
            return op.Add(x, mlp(op, h))


def gather_positions(g: Graph, cfg: MLAConfig, x: ir.Value, positions: ir.Value | None) -> ir.Value:
    """x [b, T, d] at positions [b, n] -> [b, n, d] (all of x where None): only the asked-for positions reach the
    (large) vocabulary projection."""
    if positions is None:
        return x
    index = g.op.Expand(g.op.Unsqueeze(positions, [-1]), [1, 1, cfg.hidden_size])  # [b, n] -> [b, n, 1] -> [b, n, d]
    return g.op.GatherElements(x, index, axis=1)  # [b, n, d]


def vocabulary(g: Graph, cfg: MLAConfig, t: Tensors, x: ir.Value) -> ir.Value:
    """The output layer over normed hidden states [b, n, d] -> logits [b, n, vocab] float32 (shared by the MTP draft:
    the same initializers)."""
    op = g.op
    if cfg.tie_word_embeddings and g.plan.quantization:  # the head multiplies by the embedding's own codes
        return g.to_float(op, linear(g, op, x, "embed", lambda: t("model.embed_tokens.weight").T, head=True))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return g.to_float(op, linear(g, op, x, "lm_head", lambda: t(head).T, head=True))  # [b, n, vocab] float32
