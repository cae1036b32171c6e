"""The two graphs over the io_spec contract, built from the plan: prefill (any number of new tokens, naive attention)
and decode (one token, absorbed)."""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from .. import io_spec
from ..config import MLAConfig
from .attention import Caches, MLAttention, attention_bias
from .builder import Graph, Tensors
from .model import decoder
from .plan import ExportPlan
from .weights import WeightsFile


def build_graph(kind: str, cfg: MLAConfig, t: Tensors, plan: ExportPlan, weights: WeightsFile, metadata: dict[str, str],
                on_layer: Callable[[int], None] = lambda i: None) -> ir.Model:
    """prefill or decode; `weights` is the file both graphs' initializers live in."""
    g = Graph(kind, weights, plan)
    op = g.op
    specs_in, specs_out = io_spec.graph_io(kind, cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                           cfg.vocab_size, cache_dtype=plan.cache_format)
    inputs = {spec.name: g.input(spec) for spec in specs_in}
    write_indices = inputs[io_spec.WRITE_INDICES]
    bias = attention_bias(op, inputs[io_spec.INPUT_IDS], inputs[io_spec.ATTENTION_MASK], write_indices)  # [b, 1, T, cap]
    caches: dict[str, ir.Value] = {}

    def attention(op, attn: MLAttention, h, cos, sin):
        i = attn.layer
        past = Caches(inputs[io_spec.past_latent(i)], inputs[io_spec.past_rope(i)],
                      inputs.get(io_spec.past_latent_scale(i)))
        if kind == io_spec.DECODE or plan.prefill_attention == "absorbed":
            out, present = attn.absorbed(op, h, cos, sin, bias, past, write_indices, chunk=kind == io_spec.PREFILL)
        else:
            out, present = attn.naive(op, h, cos, sin, bias, past, write_indices)
        caches[io_spec.present_latent(i)], caches[io_spec.present_rope(i)] = present.latent, present.rope
        if present.scale is not None:
            caches[io_spec.present_latent_scale(i)] = present.scale
        return out

    logits = decoder(g, cfg, t, inputs, attention, inputs.get(io_spec.LOGITS_POSITIONS), on_layer)
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
