"""The export plan: every choice resolved once, the graphs built from it, the manifest written from it and read back."""

import hashlib
import json

import numpy as np
import onnx
import pytest

from mla_deploy import __version__
from mla_deploy.checkpoint import Checkpoint
from mla_deploy.errors import ExportError
from mla_deploy.export import ExportOptions, ExportPlan, export
from mla_deploy.export import plan as plan_module
from mla_deploy.export.absorb import AbsorbMode
from mla_deploy.manifest import read_manifest
from mla_deploy.presets import DEMO_CHECKPOINT, preset_config, write_random_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny-v3: 4 heads (d_c 32, d_r 8), 8 experts of 32, top 2: auto picks the kernels."""
    return write_random_checkpoint(preset_config("tiny-v3"), tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


OPTION_SETS = {
    "default": ExportOptions(),
    "float16 factored": ExportOptions(dtype="float16", absorb="factored"),
    "bfloat16 portable": ExportOptions(dtype="bfloat16", experts="branches", decode_attention="ops"),
    "float16 moe": ExportOptions(dtype="float16", experts="moe"),
    "float16 computed in float16": ExportOptions(dtype="float16", compute="float16", experts="moe", absorb="fused"),
    "int4 head4": ExportOptions(quantize="int4", head_bits=4, absorb="fused", block_size=16, accuracy_level=0),
    "int8 short": ExportOptions(quantize="int8", max_seq_len=64),
    "int4 attention by CPU": ExportOptions(quantize="int4", decode_attention="avx512"),
    "int8 onnxruntime": ExportOptions(quantize="int8", quantized_ops="onnxruntime", dtype="float16"),
}


@pytest.mark.parametrize("name", sorted(OPTION_SETS))
def test_the_manifest_records_the_plan_and_the_graphs_follow_it(tiny, tmp_path, name):
    out = tmp_path / "out"
    result = export(tiny, out, OPTION_SETS[name])
    plan, manifest = result.plan, read_manifest(out)
    cfg = Checkpoint(tiny).config
    assert plan == ExportPlan.resolve(cfg, OPTION_SETS[name])
    assert ExportPlan.from_manifest(manifest) == plan
    assert {k: manifest[k] for k in plan.manifest_fields(cfg)} == plan.manifest_fields(cfg)
    recipe = plan.recipe(manifest["source"]["sha256"], __version__)
    assert manifest["export_id"] == hashlib.sha256(recipe.encode()).hexdigest()[:32]
    for spec in manifest["graphs"]["decode"]["inputs"][4:]:  # the caches, in the plan's cache dtype
        assert spec["dtype"] == plan.cache_dtype
    decode = manifest["graphs"]["decode"]["op_counts"]
    kernel_ops = {op.split("::")[1] for op in decode if op.startswith("mla_deploy::")}
    assert any(op.startswith("LatentAttention") for op in kernel_ops) == (plan.decode_attention != "ops")
    assert any(op.endswith("Avx512") for op in kernel_ops) == (plan.decode_attention == "avx512")
    assert any("RoutedExperts" in op for op in kernel_ops) == (plan.experts == "kernel")
    assert any(op.startswith(("QMatMul", "QGather")) for op in kernel_ops) == (plan.quantized_ops == "kernel")
    assert ("com.microsoft::MatMulNBits" in decode) == (plan.quantized_ops == "onnxruntime")
    assert ("com.microsoft::QMoE" in decode) == (plan.experts == "qmoe")
    assert ("com.microsoft::MoE" in decode) == (plan.experts == "moe")
    assert ("If" in decode) == (plan.experts == "branches")
    prefill_ops = {
        op.split("::")[1] for op in manifest["graphs"]["prefill"]["op_counts"] if op.startswith("mla_deploy::")
    }
    half = {"MatMulF16", "MatMulBF16"}
    assert bool((kernel_ops | prefill_ops) & half) == plan.half_kernels  # quantized: kv_b, a prefill weight
    model = onnx.load(str(out / "decode.onnx"), load_external_data=False)
    assert {p.key: p.value for p in model.metadata_props}["export_id"] == manifest["export_id"]
    assert manifest["precision"]["compute"] == plan.compute
    if plan.compute != "float32":  # every weight multiplied as stored: no Cast of a weight (folded into a copy)
        weights = {t.name: t for t in model.graph.initializer}
        cast = [n.input[0] for n in model.graph.node if n.op_type == "Cast" and n.input[0] in weights
                and np.prod(weights[n.input[0]].dims) > 256]
        assert not cast, cast


def test_auto_resolves_by_the_rules():
    demo = Checkpoint(DEMO_CHECKPOINT).config
    plan = ExportPlan.resolve(demo, ExportOptions())
    assert (plan.absorb, plan.experts, plan.decode_attention, plan.long_cache) == (AbsorbMode.FACTORED, "kernel",
                                                                                   "kernel", False)
    assert (plan.dtype, plan.compute, plan.cache_dtype, plan.max_seq_len) == ("float32", "float32", "float32", 1024)
    quantized = ExportPlan.resolve(demo, ExportOptions(quantize="int4", dtype="bfloat16"))
    assert (quantized.quantized_ops, quantized.experts, quantized.quantization.scale_dtype) == ("kernel", "kernel",
                                                                                                "float16")
    assert quantized.quantization.bits == 4 and quantized.cache_dtype == "bfloat16"
    portable = ExportPlan.resolve(demo, ExportOptions(quantize="int4", quantized_ops="onnxruntime"))
    assert (portable.experts, portable.quantization.scale_dtype) == ("qmoe", "float32")
    assert ExportPlan.resolve(demo, ExportOptions(max_seq_len=16)).max_seq_len == 16


def test_the_prefill_attention_follows_the_cache_and_the_absorbed_weights():
    """Per call (the cheaper of naive and absorbed) but where the two forms would compute different values: over an
    int8 cache the decode kernel reads, absorbed always; quantized fused matrices (rounded after absorption), naive."""
    demo = Checkpoint(DEMO_CHECKPOINT).config

    def form(**options) -> str:
        return ExportPlan.resolve(demo, ExportOptions(**options)).prefill_attention

    assert form() == form(absorb="fused") == form(quantize="int4") == form(dtype="bfloat16") == "per-chunk"
    assert form(quantize="int4", absorb="factored") == form(cache_dtype="int8", decode_attention="ops") == "per-chunk"
    assert form(quantize="int4", absorb="fused") == form(quantize="int8", absorb="fused") == "naive"
    assert form(cache_dtype="int8") == "absorbed"
    assert form(prefill_attention="naive") == form(cache_dtype="int8", prefill_attention="naive") == "naive"
    assert form(quantize="int4", absorb="fused", prefill_attention="naive") == "naive"
    with pytest.raises(ExportError, match="per-chunk: the quantized fused matrices"):
        form(quantize="int4", absorb="fused", prefill_attention="per-chunk")
    with pytest.raises(ExportError, match="--prefill-attention absorbed: expected one of auto, per-chunk, naive"):
        form(prefill_attention="absorbed")


def test_the_long_cache_form_follows_the_length(monkeypatch):
    cfg = Checkpoint(DEMO_CHECKPOINT).config  # d_c 64
    monkeypatch.setattr(plan_module, "LONG_CACHE_BYTES", 64 * 4 * 100)  # 100 slots of float32 latent
    assert not ExportPlan.resolve(cfg, ExportOptions(max_seq_len=100)).long_cache
    assert ExportPlan.resolve(cfg, ExportOptions(max_seq_len=101)).long_cache


def test_a_manifest_without_the_long_cache_field_reads_back_by_the_rule(tiny, tmp_path):
    out = tmp_path / "out"
    plan = export(tiny, out, ExportOptions()).plan
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["long_cache"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert ExportPlan.from_manifest(read_manifest(out)) == plan


@pytest.mark.parametrize(
    "options,message",
    [
        (ExportOptions(dtype="float8"), "--dtype float8: dtype 'float8': expected one of float32, float16, bfloat16"),
        (ExportOptions(experts="dense"), "--experts dense: expected one of auto, qmoe, kernel, moe, branches"),
        (ExportOptions(decode_attention="fast"), "--decode-attention fast: expected one of auto, kernel, avx512, ops"),
        (ExportOptions(quantize="int3"), "--quantize int3: expected one of int4, int8"),
        (ExportOptions(head_bits=4), "--head-bits 4: the embedding and output layer keep"),
        (ExportOptions(quantized_ops="kernel"), "--quantized-ops kernel: chooses the ops of quantized weights"),
        (ExportOptions(block_size=64), "--block-size 64: applies to quantized weights (add --quantize int4 or int8)"),
        (ExportOptions(accuracy_level=0), "--accuracy-level 0: applies to quantized weights"),
        (ExportOptions(quantize="int4", block_size=48), "--block-size 48: expected one of 16, 32, 64, 128"),
        (ExportOptions(quantize="int8", accuracy_level=1), "--accuracy-level 1: expected one of 0, 4"),
        (
            ExportOptions(quantize="int4", quantized_ops="ort"),
            "--quantized-ops ort: expected one of auto, kernel, onnxruntime",
        ),
        (ExportOptions(compute="float64"), "--compute float64: expected one of auto, float32, float16"),
        (ExportOptions(compute="float16"), "--compute float16: computes in the weights' stored dtype (add --dtype "
                                           "float16; this export stores float32)"),
        (ExportOptions(compute="float16", dtype="float16", quantize="int4"),
         "--compute float16: with --quantize int4 the quantized ops compute in float32"),
    ],
)
def test_a_bad_option_fails_before_the_checkpoint_is_read(tmp_path, options, message):
    with pytest.raises(ExportError, match=message.replace("(", r"\(").replace(")", r"\)")):
        export(tmp_path / "no-such-checkpoint", tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_choices_that_need_the_config_are_refused_by_name(tiny, tmp_path):
    cfg = Checkpoint(tiny).config
    with pytest.raises(ExportError, match="--max-seq-len 5000: must be between 1 and max_position_embeddings=4096"):
        ExportPlan.resolve(cfg, ExportOptions(max_seq_len=5000))
    with pytest.raises(ExportError, match="--experts kernel over quantized weights is mla_deploy.QRoutedExperts"):
        ExportPlan.resolve(cfg, ExportOptions(quantize="int8", experts="kernel", quantized_ops="onnxruntime"))
    with pytest.raises(ExportError, match="--experts moe multiplies by float experts; over quantized ones use qmoe"):
        ExportPlan.resolve(cfg, ExportOptions(quantize="int4", experts="moe"))


def test_choices_that_change_the_graphs_change_the_export_id(tiny):
    """The id that keeps stages and graphs of different exports apart hashes every choice that changes a graph: the
    compute precision, the prefill's form."""
    cfg = Checkpoint(tiny).config

    def recipe(**options):
        return ExportPlan.resolve(cfg, ExportOptions(**options)).recipe("source", __version__)

    assert recipe(dtype="float16") != recipe(dtype="float16", compute="float16")
    assert recipe(cache_dtype="int8") != recipe(cache_dtype="int8", prefill_attention="per-chunk")
    assert recipe(dtype="float16") == recipe(dtype="float16")
