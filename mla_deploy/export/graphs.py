"""The two graphs over the io_spec contract, built from the plan: prefill (any number of new tokens, naive attention)
and decode (one token, absorbed); for one stage of a staged export, the same two over the stage's layers."""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from .. import io_spec
from ..config import MLAConfig
from .attention import MLAttention, attention_bias
from .builder import Graph, Tensors
from .model import decoder
from .plan import ExportPlan
from .weights import WeightsFile


def build_graph(kind: str, cfg: MLAConfig, t: Tensors, plan: ExportPlan, weights: WeightsFile, metadata: dict[str, str],
                on_layer: Callable[[int], None] = lambda i: None, stage: io_spec.Stage | None = None) -> ir.Model:
    """prefill or decode (of one `stage` of a staged export); `weights` is the file both graphs' initializers live
    in."""
    g = Graph(kind, weights, plan)
    op = g.op
    specs_in, specs_out = io_spec.graph_io(kind, cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                           cfg.vocab_size, cache_dtype=plan.cache_dtype, stage=stage,
                                           hidden_size=cfg.hidden_size)
    inputs = {spec.name: g.input(spec) for spec in specs_in}
    write_indices = inputs[io_spec.WRITE_INDICES]
    new = inputs.get(io_spec.INPUT_IDS, inputs.get(io_spec.HIDDEN_STATES))  # [b, T] or [b, T, d]: T new tokens
    bias = attention_bias(op, new, inputs[io_spec.ATTENTION_MASK], write_indices)  # [b, 1, T, cap]
    caches: dict[str, ir.Value] = {}

    def attention(op, attn: MLAttention, h, cos, sin):
        i = attn.layer
        cache = (inputs[io_spec.past_latent(i)], inputs[io_spec.past_rope(i)], write_indices)
        form = attn.naive if kind == io_spec.PREFILL else attn.absorbed
        out, latent, rope = form(op, h, cos, sin, bias, *cache)
        caches[io_spec.present_latent(i)], caches[io_spec.present_rope(i)] = latent, rope
        return out

    out = decoder(g, cfg, t, inputs, attention, inputs.get(io_spec.LOGITS_POSITIONS), on_layer, stage)
    for spec in specs_out:  # the caches' TensorScatter outputs become present_* themselves
        g.output(out if spec.name in (io_spec.LOGITS, io_spec.HIDDEN_STATES_OUT) else caches[spec.name], spec)
    return g.model({**metadata, "graph": kind})


def op_counts(model: ir.Model) -> dict[str, int]:
    """Nodes per operator over the whole graph, If branches included (domain-qualified outside the ONNX domain)."""
    counts: dict[str, int] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
