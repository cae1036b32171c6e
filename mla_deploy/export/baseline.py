"""The decompressed-K/V decode graph: the layout other ONNX exporters use, built here as a benchmark baseline.

Per layer it caches full per-head keys [b, h, past, d_nope + d_r] and values [b, h, past, d_v]
(n_h·(d_nope + d_r + d_v) elements per token instead of d_c + d_r) and grows them with Concat,
as those exporters do. Projections, RoPE and the MoE are this project's own, so a comparison with
the absorbed graphs isolates the cache layout and the attention form. Not for deployment.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from .. import __version__, io_spec
from ..checkpoint import Checkpoint
from . import absorb, layers
from .exporter import _attach_external, _write_weights
from .graphs import decoder
from .onnx_builder import GraphBuilder

MHA_FILE = "decode_mha.onnx"
MHA_WEIGHTS = "weights_mha.bin"


def build_mha_decode(cfg, t, max_seq_len: int, weights: dict) -> GraphBuilder:
    g = GraphBuilder(io_spec.DECODE_MHA, weights)
    h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    inputs, outputs = io_spec.mha_graph_io(cfg.num_hidden_layers, h, dn + dr, dv, cfg.vocab_size)
    for spec in inputs:
        g.input(spec.name, spec.dtype, spec.shape)

    def attention(attn, hn: str, cos: str, sin: str) -> str:
        """Decompress the new token's K/V per head, append to the full caches with Concat, attend."""
        i = attn.layer
        q_in, q_weight = attn.query_input(hn)
        q = layers.linear(g, q_in, f"layers.{i}.attn.q", absorb.query_weight(cfg, q_weight))
        q = g.Transpose(g.Reshape(q, g.const([0, 0, h, dn + dr])), perm=[0, 2, 1, 3])  # [b, h, 1, d_nope + d_r]
        q_nope, q_pe = g.op("Split", q, g.const([dn, dr]), outputs=2, axis=-1)
        q_pe = layers.rope(g, q_pe, g.Unsqueeze(cos, g.const([1])), g.Unsqueeze(sin, g.const([1])))
        latent, k_pe = attn.latent_and_rope(hn, cos, sin)  # [b, 1, d_c], [b, 1, d_r]
        kv = layers.linear(g, latent, f"layers.{i}.attn.kv_b", t(attn.hf + "kv_b_proj.weight").T)
        kv = g.Transpose(g.Reshape(kv, g.const([0, 0, h, dn + dv])), perm=[0, 2, 1, 3])  # [b, h, 1, d_nope + d_v]
        k_nope, v = g.op("Split", kv, g.const([dn, dv]), outputs=2, axis=-1)
        k_pe = g.Expand(g.Unsqueeze(k_pe, g.const([1])), g.Concat(g.Shape(k_nope, end=3), g.const([dr]), axis=0))  # [b, h, 1, d_r]
        key = g.Concat(k_nope, k_pe, axis=-1)  # [b, h, 1, d_nope + d_r]
        keys = g.op("Concat", io_spec.past_key(i), key, axis=2, out_names=[io_spec.present_key(i)])  # [b, h, past + 1, ·]
        values = g.op("Concat", io_spec.past_value(i), v, axis=2, out_names=[io_spec.present_value(i)])  # [b, h, past + 1, d_v]
        query = g.Concat(q_nope, q_pe, axis=-1)  # [b, h, 1, d_nope + d_r]
        keys_t = g.Transpose(keys, perm=[0, 1, 3, 2])  # [b, h, d_nope + d_r, past + 1]
        scores = g.Mul(g.MatMul(query, keys_t), g.const(attn.scale, np.float32))  # [b, h, 1, past + 1]
        o = g.MatMul(g.Softmax(scores, axis=-1), values)  # [b, h, 1, d_v]
        o = g.Reshape(g.Transpose(o, perm=[0, 2, 1, 3]), g.const([0, 0, h * dv]))  # [b, 1, h·d_v]
        return layers.linear(g, o, f"layers.{i}.attn.o", t(attn.hf + "o_proj.weight").T)

    logits = decoder(g, cfg, t, max_seq_len, attention)
    for spec in outputs:
        g.output(logits if spec.name == io_spec.LOGITS else spec.name, spec.name, spec.dtype, spec.shape)
    return g


def export_mha_baseline(checkpoint_dir: str | Path, out_dir: str | Path, max_seq_len: int | None = None) -> Path:
    """Write decode_mha.onnx + its weights beside (or into) an export directory; reused if present."""
    out = Path(out_dir)
    if (out / MHA_FILE).exists():
        return out / MHA_FILE
    ckpt = Checkpoint(checkpoint_dir)
    cfg = ckpt.config
    weights: dict = {}
    model = build_mha_decode(cfg, ckpt.tensor, max_seq_len or cfg.max_position_embeddings, weights).to_model(
        {"producer": "mla-deploy", "mla_deploy_version": __version__, "graph": io_spec.DECODE_MHA})
    out.mkdir(parents=True, exist_ok=True)
    offsets = _write_weights(out / MHA_WEIGHTS, weights)
    _attach_external(model, weights, offsets, MHA_WEIGHTS)
    onnx.save_model(model, out / MHA_FILE)
    return out / MHA_FILE
