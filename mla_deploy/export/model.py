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
            logits_positions: ir.Value | None = None, on_layer: Callable[[int], None] = lambda i: None,
            hidden: bool = False) -> tuple[ir.Value, ir.Value | None]:
    """input_ids, position_ids -> logits [b, n, vocab] (at logits_positions; all positions where None) and, with
    `hidden`, the final hidden state [b, T, d] float32 at every position (after the final norm: what the head reads,
    and what the MTP draft reads); on_layer(i) after each layer (weights written). Without `hidden`, what follows the
    last attention (its MLP or MoE, the final norm, the head) works token by token and no cache needs it: only the
    positions whose logits are asked for go on (llama.cpp's inp_out_ids)."""
    op, eps = g.op, cfg.rms_norm_eps
    x = embedding(g, inputs[io_spec.INPUT_IDS], lambda: t("model.embed_tokens.weight"))  # [b, T, d]
    cos, sin = rope_lookup(g, cfg, inputs[io_spec.POSITION_IDS])  # [b, T, d_r/2]
    last = cfg.num_hidden_layers - 1
    for i in range(cfg.num_hidden_layers):
        x = decoder_layer(g, cfg, t, i, x, cos, sin, attention, None if hidden or i < last else logits_positions)
        on_layer(i)
    x = RMSNorm(g, "final_norm", "model.norm.weight", t, eps)(op, x)  # [b, T or n, d]
    if not hidden:
        return vocabulary(g, cfg, t, x), None
    return vocabulary(g, cfg, t, gather_positions(g, cfg, x, logits_positions)), g.to_float(op, x)


def decoder_layer(g: Graph, cfg: MLAConfig, t: Tensors, i: int, x: ir.Value, cos: ir.Value, sin: ir.Value,
                  attention: AttentionFn, positions: ir.Value | None = None) -> ir.Value:
    """modeling.model.DecoderLayer: layer i (HF weights model.layers.{i}.*) with the graph's attention; `positions`:
    only those go on after the attention (the last layer of a graph that needs no hidden state elsewhere)."""
    op, eps, hf = g.op, cfg.rms_norm_eps, f"model.layers.{i}."
    with g.scope(f"layers.{i}"):
        h = RMSNorm(g, f"layers.{i}.input_norm", hf + "input_layernorm.weight", t, eps)(op, x)
        with g.scope("attn"):
            x = op.Add(x, attention(op, MLAttention(g, cfg, t, i), h, cos, sin))
        x = gather_positions(g, cfg, x, positions)  # [b, n, d]
        h = RMSNorm(g, f"layers.{i}.post_norm", hf + "post_attention_layernorm.weight", t, eps)(op, x)
        with g.scope("mlp"):
            mlp = (MoE(g, cfg, t, i) if cfg.is_moe_layer(i)
                   else SwiGLU(g, f"layers.{i}.mlp", hf + "mlp.", t, cfg.intermediate_size))
            return op.Add(x, mlp(op, h))


def gather_positions(g: Graph, cfg: MLAConfig, x: ir.Value, positions: ir.Value | None) -> ir.Value:
    """x [b, T, d] at positions [b, n] -> [b, n, d] (all of x where None)."""
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
