"""Half-precision exports (--dtype float16 / bfloat16): every test configuration exports and verifies, the float32
islands hold where half precision overflows, the caches are stored in the dtype end to end, and the exactness
check needs both the rounded weights and the rounded caches (it fails without either)."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mla_deploy import io_spec
from mla_deploy.checkpoint import Checkpoint
from mla_deploy.cli import main
from mla_deploy.config import MLAConfig
from mla_deploy.errors import ExportError, InputError
from mla_deploy.export import ExportOptions, export
from mla_deploy.export import absorb as absorb_module
from mla_deploy.export.precision import FLOAT16_MAX, RoundedCheckpoint, round_weight
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, Generator
from mla_deploy.runtime.feeds import prefill_feed
from mla_deploy.runtime.scheduler import Request, Scheduler, TokenEvent
from mla_deploy.safetensors_io import bf16_to_float32
from mla_deploy import verify as verify_module
from mla_deploy.manifest import read_manifest
from mla_deploy.verify import COMPUTE_RTOL, RTOL, verify_export
from tiny import VARIANTS, build_hf_model, save_hf_model

DTYPES = ("float16", "bfloat16")


@pytest.fixture(scope="module")
def half(checkpoint_dir, tmp_path_factory):
    built = {}

    def get(variant, dtype, absorb="factored", quantize=None):
        key = (variant, dtype, absorb, quantize)
        if key not in built:
            out = tmp_path_factory.mktemp(f"{dtype}-{variant}") / "out"
            export(checkpoint_dir(variant)[0], out, ExportOptions(absorb=absorb, dtype=dtype, quantize=quantize,
                                                                  block_size=quantize and 16, experts="branches"))
            built[key] = out
        return built[key]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_config_exports_and_verifies(checkpoint_dir, half, variant, dtype):
    report = verify_export(half(variant, dtype), checkpoint_dir(variant)[0], steps=6)
    assert report.passed, report.lines
    assert report.rtol == RTOL[dtype]


@pytest.mark.parametrize("absorb", ["fused", "factored"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_float16_compute_verifies_and_generates_like_the_float32_compute(checkpoint_dir, half, tmp_path, variant,
                                                                          absorb):
    """--compute float16 (the GPU's form): onnxruntime's MatMul and MoE over the weights as stored, the layers in
    float16 outside the float32 islands; the CPU runs it too, so its parity is checked here."""
    src = checkpoint_dir(variant)[0]
    out = tmp_path / "out"
    export(src, out, ExportOptions(absorb=absorb, dtype="float16", compute="float16", experts="moe"))
    report = verify_export(out, src, steps=4)
    assert report.passed, report.lines
    assert report.rtol == COMPUTE_RTOL["float16"] and report.token_agreement == 1.0
    print(f"float16 compute {variant} {absorb}: worst / tolerance {report.worst / report.tolerance:.3f}")
    assert read_manifest(out)["precision"]["compute"] == "float16"


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_form_and_quantized_half_exports_verify(checkpoint_dir, half, dtype):
    src = checkpoint_dir("v3_lora_group_yarn")[0]
    assert verify_export(half("v3_lora_group_yarn", dtype, absorb="fused"), src, steps=4).passed
    report = verify_export(half("v3_lora_group_yarn", dtype, quantize="int4"), src, steps=4)
    assert report.passed, report.lines


def test_half_and_quantized_exports_report_their_quality_against_the_float_source(checkpoint_dir, half, exported):
    variant = "v3_dense_tied"
    src = checkpoint_dir(variant)[0]
    plain = verify_export(exported(variant, "factored"), src, steps=3)
    assert plain.quality is None and not any(line.startswith("quality") for line in plain.lines)
    for out in (half(variant, "float16"), half(variant, "bfloat16", quantize="int4")):
        report = verify_export(out, src, steps=3)
        q = report.quality
        assert q["positions"] == 13 + 7 + 3 + 3 * 3  # every prompt position and every decode step
        assert 0.5 <= q["top1"] <= 1.0 and 0 < q["mean_abs"] <= q["max_abs"]
        assert any(line.startswith("quality  against the float32 source") for line in report.lines)
    assert (
        q["max_abs"] > 10 * verify_export(half(variant, "bfloat16"), src, steps=3).quality["max_abs"]
    )  # int4 costs more


def test_bfloat16_is_exact_only_against_rounded_weights_and_rounded_caches(checkpoint_dir, half, monkeypatch):
    """bfloat16 computes in float32: against the source with its weights and its cache entries rounded to bfloat16 it
    agrees to float32 arithmetic (rtol 1e-3; measured <= 9e-5); leave out either rounding and it fails."""
    variant = "v3_lora_group_yarn"
    out, src = half(variant, "bfloat16"), checkpoint_dir(variant)[0]
    assert verify_export(out, src, steps=4).passed
    real = verify_module.layerwise_logits
    monkeypatch.setattr("mla_deploy.verify.layerwise_logits", lambda *a, stored=None, **kw: real(*a, **kw))
    assert not verify_export(out, src, steps=4).passed
    monkeypatch.undo()
    monkeypatch.setattr("mla_deploy.verify.RoundedCheckpoint", lambda ckpt, dtype: ckpt)
    assert not verify_export(out, src, steps=4).passed


@pytest.mark.parametrize("dtype, itemsize", [("float16", 2), ("bfloat16", 2)])
def test_caches_and_weights_are_stored_in_the_dtype(checkpoint_dir, half, exported, dtype, itemsize):
    variant = "v2_nolora_greedy_yarn"
    out = half(variant, dtype)
    manifest = json.loads((out / "manifest.json").read_text())
    caches = [s for s in manifest["graphs"]["decode"]["inputs"] if s["name"].startswith("past_")]
    assert caches and {s["dtype"] for s in caches} == {dtype}
    logits = [s for s in manifest["graphs"]["decode"]["outputs"] if s["name"] == io_spec.LOGITS]
    assert logits[0]["dtype"] == "float32"
    model = ExportedModel(out)
    state = Generator(model).new_state([np.arange(5)])
    assert {a.dtype.itemsize for a in state.caches.arrays.values()} == {itemsize}
    f32 = exported(variant, "factored")
    ratio = (out / "weights.bin").stat().st_size / (f32 / "weights.bin").stat().st_size
    assert 0.5 <= ratio < 0.6  # half the bytes, but norms, router, rope and the per-head W^UK / W^UV stay float32


def test_half_exports_generate_like_the_rounded_source_through_generator_and_scheduler(checkpoint_dir, half):
    """Greedy tokens of a bfloat16 export (exact up to float32 arithmetic) equal verify's checked ones, through the
    Generator and, row by row in one batch, through the continuous-batching scheduler."""
    variant = "v2_group_limited"
    model = ExportedModel(half(variant, "bfloat16"))
    prompts = [[5, 9, 2, 7, 1, 3], [8, 8, 4], list(range(10, 30))]
    alone = [Generator(model, stop_token_ids=()).generate([p], 8).token_ids[0] for p in prompts]
    scheduler = Scheduler(model, max_batch=4)
    streams = [[] for _ in prompts]
    for p, stream in zip(prompts, streams):
        scheduler.add(Request(p, 8, lambda e, s=stream: s.append(e.token) if isinstance(e, TokenEvent) else None))
    for _ in range(100):
        if not scheduler.has_work():
            break
        scheduler.step()
    assert streams == alone


def test_a_float32_cache_given_to_a_bfloat16_graph_is_refused_by_name(half):
    model = ExportedModel(half("v3_dense_tied", "bfloat16"))
    feed = prefill_feed(model.config, np.array([[1, 2, 3]]))  # float32 caches
    with pytest.raises(
        InputError, match=r"past_latent\.0: dtype float32, expected bfloat16: numpy uint16 \(bfloat16 bit"
    ):
        model.run(io_spec.PREFILL, feed)
    good = prefill_feed(model.config, np.array([[1, 2, 3]]), cache_dtype="bfloat16")
    out = model.run(io_spec.PREFILL, good)
    assert out[io_spec.present_latent(0)].dtype == np.uint16 and np.isfinite(out[io_spec.LOGITS]).all()
    assert not good[io_spec.past_latent(0)].any()  # the feed is left as it was: the outputs are new arrays
    written = bf16_to_float32(out[io_spec.present_latent(0)][0, :3])
    assert np.abs(written).max() > 0  # the three prompt tokens' latents, written in bfloat16


def _scaled_checkpoint(checkpoint_dir, tmp_path, scale: float):
    """v2_nolora_greedy_yarn with W^Q's nope columns and W^UK's rows scaled by `scale`: the fused W^Q·W^UK product
    and the absorbed query grow by scale², far beyond float16, while every weight stays inside its range."""
    model = build_hf_model("v2_nolora_greedy_yarn")
    cfg = model.config
    h, dn, dr, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.view(h, dn + dr, -1)[:, :dn] *= scale
            attn.kv_b_proj.weight.view(h, dn + dv, -1)[:, :dn] *= scale
    out = tmp_path / "scaled"
    save_hf_model(model, out)
    return out


def test_float32_islands_hold_where_float16_overflows(checkpoint_dir, tmp_path):
    src = _scaled_checkpoint(checkpoint_dir, tmp_path, 3000.0)
    ckpt = Checkpoint(src)
    cfg: MLAConfig = ckpt.config
    q, kv_b = (
        ckpt.tensor("model.layers.0.self_attn.q_proj.weight"),
        ckpt.tensor("model.layers.0.self_attn.kv_b_proj.weight"),
    )
    assert max(np.abs(q).max(), np.abs(kv_b).max()) < FLOAT16_MAX  # every weight fits float16 ...
    assert np.abs(absorb_module.fused_query_absorb(cfg, q, kv_b)).max() > FLOAT16_MAX  # ... their product does not
    for absorb in ("fused", "factored"):
        out = tmp_path / absorb
        export(src, out, ExportOptions(absorb=absorb, dtype="float16", experts="branches"))
        report = verify_export(out, src, steps=4)
        assert report.passed, report.lines


def test_a_weight_beyond_float16_is_refused_by_name(checkpoint_dir, tmp_path):
    src = _scaled_checkpoint(checkpoint_dir, tmp_path, 1e6)
    with pytest.raises(
        ExportError,
        match=r"--dtype float16: model\.layers\.\d+\.self_attn\.(q_proj|kv_b_proj)\.weight holds "
        r"\|w\| = .* beyond float16's largest value 65504; export it as bfloat16",
    ):
        export(src, tmp_path / "out", ExportOptions(dtype="float16"))
    assert not (tmp_path / "out").exists()
    export(src, tmp_path / "bf16", ExportOptions(dtype="bfloat16", absorb="factored", experts="branches"))


def test_round_weight_matches_torch_rounding():
    w = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32) * 10
    for dtype in DTYPES:
        assert np.array_equal(round_weight(w, dtype), torch.from_numpy(w).to(getattr(torch, dtype)).float().numpy())
    assert round_weight(w, "float32") is w


def test_rounded_checkpoint_rounds_every_tensor(checkpoint_dir):
    ckpt = Checkpoint(checkpoint_dir("v3_dense_tied")[0])
    rounded = RoundedCheckpoint(ckpt, "bfloat16")
    assert rounded.names() == ckpt.names()
    for name in ckpt.names():
        w = ckpt.tensor(name)
        assert np.array_equal(rounded.tensor(name), torch.from_numpy(w).bfloat16().float().numpy()), name


def test_cli_half_export_inspect_and_run(checkpoint_dir, tmp_path):
    src = checkpoint_dir("v3_lora_group_yarn")[0]
    out = tmp_path / "out"
    runner = CliRunner()
    result = runner.invoke(main, ["export", str(src), "-o", str(out), "--dtype", "bfloat16", "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "PASS: tolerance" in result.stderr and "rtol 0.001" in result.stderr
    shown = json.loads(runner.invoke(main, ["inspect", str(out), "--json"]).stdout)
    assert shown["dtype"] == "bfloat16" and shown["precision"]["compute"] == "float32"
    assert (shown["plan"]["dtype"], shown["plan"]["compute"], shown["plan"]["cache_dtype"]) == ("bfloat16", "float32",
                                                                                             "bfloat16")
    assert "bfloat16 weights computed in float32; bfloat16 caches" in runner.invoke(main, ["inspect", str(out)]).stdout
    run = runner.invoke(main, ["run", str(out), "--prompt-ids", "1,2,3", "-n", "4", "--json"])
    assert run.exit_code == 0, run.output
    assert 1 <= len(json.loads(run.stdout)["token_ids"]) <= 4  # 4 unless the model's eos comes first
    bad = runner.invoke(main, ["export", str(src), "-o", str(tmp_path / "b"), "--dtype", "float8"])
    assert bad.exit_code == 2 and "float8" in bad.stderr


@pytest.mark.parametrize("dtype", DTYPES)
def test_demo_model_quality_against_float32(tmp_path, dtype):
    """Held-out text through the trained demo model: top-1 agreement with the float32 source >= 99 % and the loss
    within 0.002 nats/token (measured: README, Precision)."""
    from mla_deploy.evaluate import evaluate

    out = tmp_path / dtype
    export(DEMO_CHECKPOINT, out, ExportOptions(dtype=dtype))
    text = tmp_path / "heldout.txt"
    text.write_text((DEMO_CHECKPOINT / "heldout.txt").read_text()[:20000])
    report = evaluate(out, text, window=256)
    assert report.passed and report.dtype == dtype
    assert report.top1_agreement >= 0.99
    assert abs(report.export_loss - report.torch_loss) < 2e-3


def test_unknown_dtype_is_refused_by_name_and_bfloat16_goes_to_cuda_where_the_build_has_it(checkpoint_dir, tmp_path):
    import onnxruntime as ort

    from mla_deploy.errors import ProviderError
    from mla_deploy.runtime.dtypes import ort_value

    with pytest.raises(ExportError, match="--dtype float8: dtype 'float8': expected one of float32, float16, bfloat16"):
        export(checkpoint_dir("v3_dense_tied")[0], tmp_path / "out", ExportOptions(dtype="float8"))
    assert not (tmp_path / "out").exists()
    if "CUDAExecutionProvider" in ort.get_available_providers():
        value = ort_value(np.zeros((1, 2, 3), np.uint16), "bfloat16", "cuda")
        assert value.data_type() == "tensor(bfloat16)" and value.device_name() == "cuda"
    else:
        refused = r"cannot allocate a bfloat16 tensor \[1, 2, 3\] on 'cuda' with this onnxruntime build"
        with pytest.raises(ProviderError, match=refused):
            ort_value(np.zeros((1, 2, 3), np.uint16), "bfloat16", "cuda")
    assert ort_value(np.zeros((1, 2, 3), np.uint16), "bfloat16").data_type() == "tensor(bfloat16)"
