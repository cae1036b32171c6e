"""The two graphs: prefill (any number of new tokens, naive attention) and decode (one token, absorbed).

`decoder` is the stack every graph shares (modeling/model.py: embedding, per-layer norm / attention /
MLP or MoE with residuals, final norm, vocabulary projection); a graph only chooses the attention of
each layer.
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from .. import io_spec
from ..config import MLAConfig
from . import decode_attention as decode_attention_module
from . import layers
from .absorb import AbsorbMode
from .precision import Precision
from .quantize import Quantization
from .weights import WeightsFile

# (op, layer attention, normed hidden [b, T, d], cos, sin) -> attention output [b, T, d]
AttentionFn = Callable[..., ir.Value]


def decoder(g: layers.Graph, cfg: MLAConfig, t: layers.Tensors, max_seq_len: int, inputs: dict[str, ir.Value],
            attention: AttentionFn, logits_positions: ir.Value | None = None,
            on_layer: Callable[[int], None] = lambda i: None) -> ir.Value:
    """input_ids, position_ids -> logits [b, n, vocab]; on_layer(i) after each layer (weights written)."""
    op, eps = g.op, cfg.rms_norm_eps
    x = g.embedding(inputs[io_spec.INPUT_IDS], lambda: t("model.embed_tokens.weight"))  # [b, T, d]
    cos, sin = layers.rope_lookup(g, cfg, inputs[io_spec.POSITION_IDS], max_seq_len)  # [b, T, d_r/2]
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        with g.scope(f"layers.{i}"):
            h = layers.RMSNorm(g, f"layers.{i}.input_norm", hf + "input_layernorm.weight", t, eps)(op, x)
            with g.scope("attn"):
                x = op.Add(x, attention(op, layers.MLAttention(g, cfg, t, i), h, cos, sin))
            h = layers.RMSNorm(g, f"layers.{i}.post_norm", hf + "post_attention_layernorm.weight", t, eps)(op, x)
            with g.scope("mlp"):
                mlp = (layers.MoE(g, cfg, t, i) if cfg.is_moe_layer(i)
                       else layers.SwiGLU(g, f"layers.{i}.mlp", hf + "mlp.", t, cfg.intermediate_size))
                x = op.Add(x, mlp(op, h))
        on_layer(i)
    if logits_positions is not None:  # only the asked-for positions reach the (large) vocabulary projection
        index = op.Expand(op.Unsqueeze(logits_positions, [-1]), [1, 1, cfg.hidden_size])  # [b, n] -> [b, n, 1] -> [b, n, d]
        x = op.GatherElements(x, index, axis=1)  # [b, n, d]
    x = layers.RMSNorm(g, "final_norm", "model.norm.weight", t, eps)(op, x)
    if cfg.tie_word_embeddings and g.quantization:  # the head multiplies by the embedding's own codes
        return g.to_float(op, layers.linear(g, op, x, "embed", lambda: t("model.embed_tokens.weight").T, head=True))
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return g.to_float(op, layers.linear(g, op, x, "lm_head", lambda: t(head).T, head=True))  # [b, n, vocab] float32


def build_graph(kind: str, cfg: MLAConfig, t: layers.Tensors, max_seq_len: int, absorb: AbsorbMode,
                weights: WeightsFile, metadata: dict[str, str], on_layer: Callable[[int], None] = lambda i: None,
                quantization: Quantization | None = None, experts: str = "branches",
                precision: Precision = Precision("float32"), decode_attention: str = "ops") -> ir.Model:
    """prefill or decode over the io_spec contract; `weights` is the file both graphs' initializers live in;
    `decode_attention`: export.decode_attention's choice."""
    g = layers.Graph(kind, weights, quantization, experts, precision)
    op = g.op
    specs_in, specs_out = io_spec.graph_io(kind, cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                           cfg.vocab_size, cache_dtype=precision.dtype)
    inputs = {spec.name: g.input(spec) for spec in specs_in}
    write_indices = inputs[io_spec.WRITE_INDICES]
    bias = layers.attention_bias(op, inputs[io_spec.INPUT_IDS], inputs[io_spec.ATTENTION_MASK], write_indices)  # [b, 1, T, cap]
    caches: dict[str, ir.Value] = {}
    long_cache = decode_attention_module.long_cache(cfg, max_seq_len, layers.LONG_CACHE_BYTES)

    def attention(op, attn: layers.MLAttention, h, cos, sin):
        i = attn.layer
        cache = (inputs[io_spec.past_latent(i)], inputs[io_spec.past_rope(i)], write_indices)
        if kind == io_spec.PREFILL:
            out, latent, rope = attn.naive(op, h, cos, sin, bias, *cache)
        else:
            out, latent, rope = attn.absorbed(op, h, cos, sin, bias, *cache, mode=absorb, long_cache=long_cache,
                                              attention=decode_attention)
        caches[io_spec.present_latent(i)], caches[io_spec.present_rope(i)] = latent, rope
        return out

    logits = decoder(g, cfg, t, max_seq_len, inputs, attention, inputs.get(io_spec.LOGITS_POSITIONS), on_layer)
    for spec in specs_out:  # the caches' TensorScatter outputs become present_* themselves
        g.output(logits if spec.name == io_spec.LOGITS else caches[spec.name], spec)
    return g.model({**metadata, "graph": kind})


def op_counts(model: ir.Model) -> dict[str, int]:
    """Nodes per operator over the whole graph, If branches included (domain-qualified outside the ONNX domain)."""
    counts: dict[str, int] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
