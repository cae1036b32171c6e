"""modeling/model.py as graph code: the decoder stack every graph shares (embedding, per-layer norm / attention /
MLP or MoE with residuals, final norm, vocabulary projection); a graph only chooses the attention of each layer.
A stage of a staged export is the same stack over its range of layers: the first stage starts from the embedding,
the others from the hidden states the stage before returns, and only the last ends in the final norm and head."""

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
            stage: io_spec.Stage | None = None) -> ir.Value:
    """input_ids, position_ids -> logits [b, n, vocab]; on_layer(i) after each layer (weights written). A `stage`
    runs its layers only, from hidden_states [b, T, d] unless it is the first, to hidden_states_out [b, T, d]
    (float32) unless it is the last."""
    op, eps = g.op, cfg.rms_norm_eps
    stage = stage or io_spec.Stage.whole(cfg.num_hidden_layers)
    if stage.first:
        x = embedding(g, inputs[io_spec.INPUT_IDS], lambda: t("model.embed_tokens.weight"))  # [b, T, d]
    else:
        x = g.to_compute(op, inputs[io_spec.HIDDEN_STATES])  # [b, T, d]
    cos, sin = rope_lookup(g, cfg, inputs[io_spec.POSITION_IDS])  # [b, T, d_r/2]
    for i in stage.layers:
        hf = f"model.layers.{i}."
        with g.scope(f"layers.{i}"):
            h = RMSNorm(g, f"layers.{i}.input_norm", hf + "input_layernorm.weight", t, eps)(op, x)
            with g.scope("attn"):
                x = op.Add(x, attention(op, MLAttention(g, cfg, t, i), h, cos, sin))
            if i == cfg.num_hidden_layers - 1 and logits_positions is not None:
                # what follows the last attention (its MLP or MoE, the final norm, the head) works token by token and
                # no cache needs it: only the positions whose logits are asked for go on (llama.cpp's inp_out_ids)
                x = _gather_positions(op, cfg, x, logits_positions)  # [b, n, d]
            h = RMSNorm(g, f"layers.{i}.post_norm", hf + "post_attention_layernorm.weight", t, eps)(op, x)
            with g.scope("mlp"):
                mlp = (MoE(g, cfg, t, i) if cfg.is_moe_layer(i)
                       else SwiGLU(g, f"layers.{i}.mlp", hf + "mlp.", t, cfg.intermediate_size))
                x = op.Add(x, mlp(op, h))
        on_layer(i)
    if not stage.last:
        return g.to_float(op, x)
    x = RMSNorm(g, "final_norm", "model.norm.weight", t, eps)(op, x)
    if cfg.tie_word_embeddings and g.plan.quantization:  # the head multiplies by the embedding's own codes
        return g.to_float(op, linear(g, op, x, "embed", lambda: t("model.embed_tokens.weight").T, head=True))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return g.to_float(op, linear(g, op, x, "lm_head", lambda: t(head).T, head=True))  # [b, n, vocab] float32


def _gather_positions(op, cfg: MLAConfig, x: ir.Value, positions: ir.Value) -> ir.Value:
    """x [b, T, d] at positions [b, n] -> [b, n, d]."""
    index = op.Expand(op.Unsqueeze(positions, [-1]), [1, 1, cfg.hidden_size])  # [b, n] -> [b, n, 1] -> [b, n, d]
    return op.GatherElements(x, index, axis=1)
