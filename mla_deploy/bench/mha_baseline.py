"""The decompressed-K/V decode graph: the layout other ONNX exporters use, built here as a benchmark baseline.

Per layer it caches full per-head keys [b, h, past, d_nope + d_r] and values [b, h, past, d_v]
(n_h·(d_nope + d_r + d_v) elements per token instead of d_c + d_r) and grows them with Concat,
as those exporters do. Projections, RoPE and the MoE are this project's own graph code (export), so a comparison
with the absorbed graphs isolates the cache layout and the attention form. Not for deployment: its I/O lives here,
not in the export contract (io_spec).
"""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir

from .. import __version__, io_spec
from ..checkpoint import Checkpoint
from ..export import absorb
from ..export.attention import MLAttention
from ..export.builder import Graph
from ..export.linear import linear
from ..export.model import decoder
from ..export.plan import ExportOptions, ExportPlan
from ..export.rope import rope
from ..export.weights import WeightsFile
from ..io_spec import INPUT_IDS, LOGITS, POSITION_IDS, TensorSpec
from ..partial import scratch_path

MHA_FILE = "decode_mha.onnx"
MHA_WEIGHTS = "weights_mha.bin"
DECODE_MHA = "decode_mha"


def past_key(layer: int) -> str:
    return f"past_key.{layer}"


def past_value(layer: int) -> str:
    return f"past_value.{layer}"


def present_key(layer: int) -> str:
    return f"present_key.{layer}"


def present_value(layer: int) -> str:
    return f"present_value.{layer}"


def mha_graph_io(num_layers: int, heads: int, key_dim: int, value_dim: int, vocab: int):
    """Decode with per-head K [b, h, past, d_nope + d_r] and V [b, h, past, d_v] caches, grown by Concat."""
    inputs = [TensorSpec(INPUT_IDS, "int64", ("batch", 1)), TensorSpec(POSITION_IDS, "int64", ("batch", 1))]
    outputs = [TensorSpec(LOGITS, "float32", ("batch", 1, vocab))]
    for i in range(num_layers):
        inputs += [TensorSpec(past_key(i), "float32", ("batch", heads, "past", key_dim)),
                   TensorSpec(past_value(i), "float32", ("batch", heads, "past", value_dim))]
        outputs += [TensorSpec(present_key(i), "float32", ("batch", heads, "total", key_dim)),
                    TensorSpec(present_value(i), "float32", ("batch", heads, "total", value_dim))]
    return inputs, outputs


def build_mha_decode(cfg, t, max_seq_len: int, weights: WeightsFile) -> ir.Model:
    """float32 weights, routed experts in branches (the plan of a plain float export, whatever the machine)."""
    g = Graph(DECODE_MHA, weights, ExportPlan.resolve(cfg, ExportOptions(max_seq_len=max_seq_len, experts="branches")))
    h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    specs_in, specs_out = mha_graph_io(cfg.num_hidden_layers, h, dn + dr, dv, cfg.vocab_size)
    inputs = {spec.name: g.input(spec) for spec in specs_in}
    presents: dict[str, ir.Value] = {}

    def attention(op, attn: MLAttention, hn, cos, sin):
        """Decompress the new token's K/V per head, append to the full caches with Concat, attend."""
        i = attn.layer
        q_in, q_weight = attn.query_input(op, hn)
        q = linear(g, op, q_in, f"layers.{i}.attn.q", lambda: absorb.query_weight(cfg, q_weight()))
        q = op.Transpose(
            op.Reshape(q, [0, 0, h, dn + dr]), perm=[0, 2, 1, 3]
        )  # -> [b, 1, h, ·] -> [b, h, 1, d_nope + d_r]
        q_nope, q_pe = op.Split(q, [dn, dr], axis=-1, _outputs=2)
        q_pe = rope(op, q_pe, cos, sin)  # [b, h, 1, d_r], cos [b, 1, d_r/2]
        latent, k_pe, _ = attn.latent_and_rope(op, hn, cos, sin)  # [b, 1, d_c], [b, 1, d_r] (float32 caches: no scale)
        kv = linear(g, op, latent, f"layers.{i}.attn.kv_b", lambda: t(attn.hf + "kv_b_proj.weight").T)
        kv = op.Transpose(
            op.Reshape(kv, [0, 0, h, dn + dv]), perm=[0, 2, 1, 3]
        )  # -> [b, 1, h, ·] -> [b, h, 1, d_nope + d_v]
        k_nope, v = op.Split(kv, [dn, dv], axis=-1, _outputs=2)
        k_pe = op.Expand(op.Unsqueeze(k_pe, [1]), op.Concat(op.Shape(k_nope, end=3), [dr], axis=0))  # [b, h, 1, d_r]
        key = op.Concat(k_nope, k_pe, axis=-1)  # [b, h, 1, d_nope + d_r]
        keys = op.Concat(inputs[past_key(i)], key, axis=2)  # [b, h, past + 1, ·]
        values = op.Concat(inputs[past_value(i)], v, axis=2)  # [b, h, past + 1, d_v]
        presents[present_key(i)], presents[present_value(i)] = keys, values
        query = op.Concat(q_nope, q_pe, axis=-1)  # [b, h, 1, d_nope + d_r]
        keys_t = op.Transpose(keys, perm=[0, 1, 3, 2])  # [b, h, d_nope + d_r, past + 1]
        scores = op.Mul(op.MatMul(query, keys_t), attn.scale)  # [b, h, 1, past + 1]
        o = op.MatMul(op.Softmax(scores, axis=-1), values)  # [b, h, 1, d_v]
        o = op.Reshape(op.Transpose(o, perm=[0, 2, 1, 3]), [0, 0, h * dv])  # -> [b, 1, h, d_v] -> [b, 1, h·d_v]
        return linear(g, op, o, f"layers.{i}.attn.o", lambda: t(attn.hf + "o_proj.weight").T)

    logits, _ = decoder(g, cfg, t, inputs, attention)  # the baseline has no hidden-state output
    for spec in specs_out:
        g.output(logits if spec.name == io_spec.LOGITS else presents[spec.name], spec)
    return g.model({"producer": "mla-deploy", "mla_deploy_version": __version__, "graph": DECODE_MHA})


def export_mha_baseline(checkpoint_dir: str | Path, out_dir: str | Path, max_seq_len: int | None = None) -> Path:
    """Write decode_mha.onnx + its weights beside (or into) an export directory; reused if present."""
    out = Path(out_dir)
    if (out / MHA_FILE).exists():
        return out / MHA_FILE
    ckpt = Checkpoint(checkpoint_dir)
    cfg = ckpt.config
    out.mkdir(parents=True, exist_ok=True)
    graph = scratch_path(out / MHA_FILE, "partial")  # renamed into place last: the graph is there only whole
    try:
        with WeightsFile(out / MHA_WEIGHTS) as weights:
            model = build_mha_decode(cfg, ckpt.tensor, max_seq_len or cfg.max_position_embeddings, weights)
        ir.save(model, graph)
        graph.replace(out / MHA_FILE)
    except BaseException:
        graph.unlink(missing_ok=True)
        (out / MHA_WEIGHTS).unlink(missing_ok=True)
        raise
    return out / MHA_FILE
