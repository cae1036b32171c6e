"""The graphs over the io_spec contract, built from the plan: prefill (any number of new tokens, naive or absorbed
attention per call),
decode (one token, absorbed), verify (any number of tokens, absorbed: speculative decoding's verification pass) and
draft (the MTP module of a V3 checkpoint: modeling/mtp.py); for one stage of a staged export, prefill and decode over
the stage's layers."""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from .. import io_spec
from ..config import MLAConfig
from .attention import Caches, ChunkCosts, ChunkForm, MLAttention, attention_bias
from .builder import Graph, Tensors
from .linear import embedding, linear
from .model import decoder, decoder_layer, vocabulary
from .norm import RMSNorm
from .plan import PER_CHUNK, ExportPlan
from .rope import rope_lookup
from .weights import WeightsFile


def build_graph(kind: str, cfg: MLAConfig, t: Tensors, plan: ExportPlan, weights: WeightsFile, metadata: dict[str, str],
                on_layer: Callable[[int], None] = lambda i: None, stage: io_spec.Stage | None = None) -> ir.Model:
    """prefill, decode, verify or draft (prefill or decode of one `stage` of a staged export); `weights` is the file
    every graph's initializers live in."""
    g = Graph(kind, weights, plan)
    op = g.op
    specs_in, specs_out = io_spec.graph_io(kind, cfg, plan.cache_format, hidden=plan.draft, stage=stage)
    inputs = {spec.name: g.input(spec) for spec in specs_in}
    write_indices = inputs[io_spec.WRITE_INDICES]
    new = inputs.get(io_spec.INPUT_IDS, inputs.get(io_spec.HIDDEN_STATES))  # [b, T] or [b, T, d]: T new tokens
    bias = attention_bias(op, new, inputs[io_spec.ATTENTION_MASK], write_indices)  # [b, 1, T, cap]
    # the prefill graph's attention, but over an int8 cache the kernel reads: per call (the slots the queries see,
    # and the form it takes) or naive always
    form = plan.prefill_attention if kind == io_spec.PREFILL else None
    if form in (PER_CHUNK, "naive"):
        chunk = ChunkForm.build(op, ChunkCosts.of(cfg, plan.absorb) if form == PER_CHUNK else None, new,
                                write_indices, bias)
    outputs: dict[str, ir.Value] = {}

    def attention(op, attn: MLAttention, h, cos, sin):
        i = attn.layer
        past = Caches(inputs[io_spec.past_latent(i)], inputs[io_spec.past_rope(i)],
                      inputs.get(io_spec.past_latent_scale(i)))
        if form == PER_CHUNK:
            out, present = attn.per_chunk(op, h, cos, sin, chunk, past, write_indices)
        elif form == "naive":
            out, present = attn.naive(op, h, cos, sin, chunk, past, write_indices)
        else:
            out, present = attn.absorbed(op, h, cos, sin, bias, past, write_indices, tokens=kind != io_spec.DECODE)
        outputs[io_spec.present_latent(i)], outputs[io_spec.present_rope(i)] = present.latent, present.rope
        if present.scale is not None:
            outputs[io_spec.present_latent_scale(i)] = present.scale
        return out

    positions = inputs.get(io_spec.LOGITS_POSITIONS)
    if kind == io_spec.DRAFT:
        logits, hidden = draft(g, cfg, t, inputs, attention, positions)
        on_layer(0)
    else:
        logits, hidden = decoder(g, cfg, t, inputs, attention, positions, on_layer, hidden=plan.draft, stage=stage)
    # a stage before the last returns its hidden states where the last returns logits
    outputs[io_spec.LOGITS if stage is None or stage.last else io_spec.HIDDEN_STATES_OUT], outputs[io_spec.HIDDEN] = \
        logits, hidden
    for spec in specs_out:  # the caches' TensorScatter outputs become present_* themselves
        g.output(outputs[spec.name], spec)
    return g.model({**metadata, "graph": kind})


def draft(g: Graph, cfg: MLAConfig, t: Tensors, inputs: dict[str, ir.Value], attention,
          positions: ir.Value) -> tuple[ir.Value, ir.Value]:
    """modeling/mtp.py as graph code: the MTP layer L = num_hidden_layers over tokens i + 1 and the main model's
    hidden states at i -> logits [b, n, vocab] and its own normed hidden state [b, n, d] (float32) at `positions`.
    The embedding and the output layer are the main graphs' own initializers: stored once in weights.bin."""
    op, eps = g.op, cfg.rms_norm_eps
    layer = io_spec.draft_layers(cfg)[0]
    hf, name = f"model.layers.{layer}.", f"layers.{layer}"
    tokens = embedding(g, inputs[io_spec.INPUT_IDS], lambda: t("model.embed_tokens.weight"))  # [b, T, d]
    tokens = RMSNorm(g, f"{name}.enorm", hf + "enorm.weight", t, eps)(op, tokens)
    previous = RMSNorm(g, f"{name}.hnorm", hf + "hnorm.weight", t, eps)(
        op, g.to_compute(op, inputs[io_spec.PREVIOUS_HIDDEN])
    )
    x = linear(
        g, op, op.Concat(tokens, previous, axis=-1), f"{name}.eh_proj", lambda: t(hf + "eh_proj.weight").T
    )  # [b, T, 2d] -> [b, T, d]: the embedding first, as DeepSeek stores it
    cos, sin = rope_lookup(g, cfg, inputs[io_spec.POSITION_IDS])
    x = decoder_layer(g, cfg, t, layer, x, cos, sin, attention, positions)  # after its attention: [b, n, d]
    hidden = RMSNorm(g, f"{name}.shared_head.norm", hf + "shared_head.norm.weight", t, eps)(op, x)
    return vocabulary(g, cfg, t, hidden), g.to_float(op, hidden)


def op_counts(model: ir.Model) -> dict[str, int]:
    """Nodes per operator over the whole graph, If branches included (domain-qualified outside the ONNX domain)."""
    counts: dict[str, int] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
