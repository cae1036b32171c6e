"""Exports with an int8 latent cache (--cache-dtype int8): the option end to end (plan, manifest, export id), every
test configuration verified against the torch source whose cache entries are rounded the same way (and failing
without that rounding), the scales written in place into the bound buffers, and the export through `run`, the
continuous-batching scheduler (rows of different lengths, cache growth) and the server."""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from mla_deploy import io_spec
from mla_deploy.cli import main
from mla_deploy.errors import ExportError, InputError
from mla_deploy.export import ExportOptions, export
from mla_deploy.export.plan import ExportPlan
from mla_deploy.io_spec import CacheFormat
from mla_deploy.manifest import read_manifest
from mla_deploy.modeling import cache as source_cache
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams, Tokenizer
from mla_deploy.runtime.cache import BLOCK
from mla_deploy.runtime.feeds import prefill_feed
from mla_deploy.runtime.scheduler import Request, Scheduler, TokenEvent
from mla_deploy.verify import RTOL, verify_export
from tiny import VARIANTS


@pytest.fixture(scope="module")
def int8(checkpoint_dir, tmp_path_factory):
    """(variant, absorb, dtype, quantize) -> an int8-cache export of that tiny checkpoint, built once."""
    built = {}

    def get(variant, absorb="factored", dtype="float32", quantize=None):
        key = (variant, absorb, dtype, quantize)
        if key not in built:
            out = tmp_path_factory.mktemp(f"int8-{variant}") / "out"
            export(
                checkpoint_dir(variant)[0],
                out,
                ExportOptions(
                    absorb=absorb, dtype=dtype, quantize=quantize, block_size=quantize and 16, experts="branches",
                    cache_dtype="int8"
                ),
            )
            built[key] = out
        return built[key]

    return get


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("int8-demo") / "out"
    export(DEMO_CHECKPOINT, out, ExportOptions(cache_dtype="int8", max_seq_len=2 * BLOCK + 64))
    return ExportedModel(out)


def test_the_cache_dtype_reaches_the_plan_manifest_graphs_and_export_id(checkpoint_dir, int8, exported):
    out = int8("v3_lora_group_yarn", "fused")
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["precision"]["caches"], manifest["precision"]["rope_cache"]) == ("int8", "float32")
    inputs = {s["name"]: s for s in manifest["graphs"]["decode"]["inputs"]}
    assert inputs["past_latent.0"]["dtype"] == "int8" and inputs["past_rope.0"]["dtype"] == "float32"
    assert inputs["past_latent_scale.2"] == {"name": "past_latent_scale.2", "dtype": "float32",
                                             "shape": ["batch", "capacity", 1]}
    float_cache = json.loads((exported("v3_lora_group_yarn", "fused") / "manifest.json").read_text())
    assert manifest["export_id"] != float_cache["export_id"]  # the cache dtype is part of the recipe
    plan = ExportPlan.from_manifest(read_manifest(out))
    assert (plan.cache_dtype, plan.rope_dtype, plan.decode_attention) == ("int8", "float32", "kernel")
    assert ExportOptions(dtype="bfloat16", cache_dtype="int8").cache_format() == CacheFormat("int8", "bfloat16")
    assert ExportOptions(dtype="bfloat16").cache_format() == CacheFormat("bfloat16", "bfloat16")  # auto: --dtype
    assert ExportOptions(dtype="bfloat16", cache_dtype="float32").cache_format() == CacheFormat("float32", "float32")
    with pytest.raises(ExportError, match="--cache-dtype int4: expected one of auto, float32, float16, bfloat16, int8"):
        ExportOptions(cache_dtype="int4").check()


def test_the_export_command_takes_the_cache_dtype(checkpoint_dir, tmp_path):
    src = checkpoint_dir("v2_group_limited")[0]
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(src), "-o", str(out), "--cache-dtype", "int8", "--steps", "3"])
    assert result.exit_code == 0, result.output
    assert "deployed attention in mla-deploy's int8 kernels" in result.output and "PASS" in result.output
    ops = CliRunner().invoke(main, ["export", str(src), "-o", str(tmp_path / "ops"), "--cache-dtype", "int8",
                                    "--decode-attention", "ops", "--steps", "3"])  # the report names what runs
    assert "deployed attention in onnxruntime's ops over the int8 cache" in ops.output and "PASS" in ops.output
    assert ExportedModel(out).cache_format == CacheFormat("int8", "float32")
    refused = CliRunner().invoke(main, ["export", str(src), "-o", str(tmp_path / "no"), "--cache-dtype", "int4"])
    assert refused.exit_code == 2 and "--cache-dtype" in refused.output and not (tmp_path / "no").exists()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_config_verifies_with_the_cache_rounded_as_written(checkpoint_dir, int8, variant):
    report = verify_export(int8(variant), checkpoint_dir(variant)[0], steps=6)
    assert report.passed, report.lines
    assert report.rtol == RTOL["int8"] and report.deployed_drift is not None


@pytest.mark.parametrize("absorb,dtype,quantize", [("fused", "float32", None), ("factored", "bfloat16", None),
                                                   ("fused", "float32", "int4")])
def test_fused_half_and_quantized_exports_verify_with_an_int8_cache(checkpoint_dir, int8, absorb, dtype, quantize):
    src = checkpoint_dir("v3_nointerleave_ungrouped")[0]
    out = int8("v3_nointerleave_ungrouped", absorb, dtype, quantize)
    assert ExportedModel(out).cache_format == CacheFormat("int8", dtype)
    report = verify_export(out, src, steps=4)
    assert report.passed, report.lines


def test_without_the_sources_rounding_the_check_fails(checkpoint_dir, int8, monkeypatch):
    """The int8 rounding is what the source must mirror: compared with unrounded cache entries the same export is
    off by far more than its tolerance."""
    variant = "v3_lora_group_yarn"
    monkeypatch.setattr(source_cache, "stored_values", lambda x, dtype: x)
    report = verify_export(int8(variant), checkpoint_dir(variant)[0], steps=4)
    assert not report.passed and max([report.prefill_max_abs, *report.decode_max_abs]) > 3 * report.tolerance


def test_scales_are_written_in_place_into_the_bound_buffers(demo, capfd):
    """The decode graph's TensorScatter outputs are the present_* outputs themselves, onnxruntime reports no copy,
    and after a step the buffers the runtime bound hold the new entries: codes and a scale at each row's slot (the
    outputs onnxruntime returns are those very buffers)."""
    for kind in ("prefill.onnx", "decode.onnx"):
        graph = onnx.load(demo.directory / kind, load_external_data=False).graph
        producers = {o: n.op_type for n in graph.node for o in n.output}
        assert all(producers[f"present_{c}.{i}"] == "TensorScatter"
                   for c in ("latent", "latent_scale", "rope") for i in range(demo.config.num_hidden_layers))
    model = ExportedModel(demo.directory, RuntimeOptions(log_severity=1))
    capfd.readouterr()
    gen = Generator(model, SamplingParams(), stop_token_ids=())
    state = gen.new_state([np.array([1, 17, 300, 42]), np.array([1, 5])])
    logits = gen.prefill(state, [[1, 17, 300, 42], [1, 5]])
    scales = state.caches.arrays[io_spec.past_latent_scale(1)]
    codes = state.caches.arrays[io_spec.past_latent(1)]
    assert (scales[0, :4, 0] > 0).all() and (scales[1, :2, 0] > 0).all()
    before, before_codes = scales.copy(), codes.copy()
    gen.decode_step(state, logits.argmax(-1))
    written = {value.data_ptr() for value in state.decode_binding.binding.get_outputs()}
    bound = {state.caches.arrays[t.past].ctypes.data for t in state.caches.tensors}
    assert bound < written  # the present outputs are the bound buffers (beside the logits), not copies
    assert state.caches.arrays[io_spec.past_latent_scale(1)] is scales
    assert before[0, 4, 0] == 0  # row 0's next slot was never written; row 1's held a pad token of the prefill
    for row, slot in ((0, 4), (1, 2)):  # the step's entry, written into the bound buffers: a scale and its codes
        assert scales[row, slot, 0] > 0 and np.abs(codes[row, slot]).max() == 127
        assert scales[row, slot, 0] != before[row, slot, 0] or (codes[row, slot] != before_codes[row, slot]).any()
    assert np.array_equal(scales[:, :2], before[:, :2]) and np.array_equal(codes[:, :2], before_codes[:, :2])
    assert "in-place optimization not activated" not in capfd.readouterr().err


def test_a_float_cache_given_to_an_int8_graph_is_refused_by_name(demo):
    feed = prefill_feed(demo.config, np.array([[1, 2, 3]]))  # float32 caches, no scales
    with pytest.raises(InputError, match=r"missing \['past_latent_scale.0', .*\]"):
        demo.run(io_spec.PREFILL, feed)
    feed = prefill_feed(demo.config, np.array([[1, 2, 3]]), cache_dtype=demo.cache_format)
    feed[io_spec.past_latent(0)] = feed[io_spec.past_latent(0)].astype(np.float32)
    with pytest.raises(InputError, match=r"past_latent\.0: dtype float32, expected int8"):
        demo.run(io_spec.PREFILL, feed)


def test_run_prints_the_generators_tokens(demo):
    result = CliRunner().invoke(main, ["run", str(demo.directory), "--prompt-ids", "1,17,300,42", "-n", "8",
                                       "--temperature", "0", "--repetition-penalty", "1", "--json"])
    assert result.exit_code == 0, result.output
    expected = Generator(demo, SamplingParams(), stop_token_ids=()).generate([[1, 17, 300, 42]], 8).token_ids[0]
    assert (
        json.loads(result.stdout)["token_ids"][: len(expected)]
        == expected[: len(json.loads(result.stdout)["token_ids"])]
    )


def test_the_scheduler_rows_equal_each_request_alone_across_a_cache_growth(demo):
    """Rows of different lengths in one batched int8 cache, one prompt past a cache block (the buffers, scales
    included, grow and are re-bound), prefilled in chunks into its row's slice: each row's tokens are its own
    Generator's."""
    rng = np.random.default_rng(3)
    prompts = [[5, 6, 7], rng.integers(3, 4000, BLOCK - 3).tolist(), rng.integers(3, 4000, 40).tolist(), [9]]
    alone = [Generator(demo, SamplingParams(), stop_token_ids=()).generate([p], 12).token_ids[0] for p in prompts]
    scheduler = Scheduler(demo, max_batch=3, prefill_chunk=64)
    streams = [[] for _ in prompts]
    for p, stream in zip(prompts, streams):
        scheduler.add(Request(p, 12, lambda e, s=stream: s.append(e.token) if isinstance(e, TokenEvent) else None))
    for _ in range(500):
        if not scheduler.has_work():
            break
        scheduler.step()
    assert streams == alone
    assert scheduler.caches.capacity == 2 * BLOCK
    assert scheduler.caches.arrays[io_spec.past_latent_scale(0)].shape == (3, 2 * BLOCK, 1)


def test_the_server_completes_with_an_int8_cache_exports_tokens(demo):
    """`serve` over the int8-cache export, several prompts at once: each completion's text is its Generator's
    greedy tokens (up to a stop token, whose own text the server leaves out)."""
    pytest.importorskip("fastapi", reason="the server needs the 'serve' extra")
    from fastapi.testclient import TestClient

    from mla_deploy.runtime.engine import Engine
    from mla_deploy.serve.app import Service, create_app

    prompts = [[1, 17, 300, 42], [1, 5], [1, 900, 901, 902, 903, 904, 905, 906]]
    tokenizer = Tokenizer.from_export(demo.directory, demo.manifest)
    expected = []
    for prompt in prompts:
        tokens = Generator(demo, SamplingParams()).generate([prompt], 16).token_ids[0]
        expected.append(tokenizer.decode([t for t in tokens if t not in demo.stop_token_ids]))
    service = Service(Engine(demo, max_batch=4), "demo", None, max_body_bytes=64 * 1024)
    try:
        with TestClient(create_app(service)) as client:
            body = {"model": "demo", "prompt": prompts, "max_tokens": 16, "temperature": 0, "repetition_penalty": 1.0}
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            texts = [c["text"] for c in sorted(reply.json()["choices"], key=lambda c: c["index"])]
    finally:
        service.engine.close()
    assert texts == expected


def test_inspect_reports_the_int8_caches_bytes(demo):
    result = CliRunner().invoke(main, ["inspect", str(demo.directory), "--json"])
    r = json.loads(result.stdout)
    cfg = demo.config
    assert r["cache"] == "MLA int8 + float32 rope"
    assert r["cache_bytes_per_token"][r["cache"]] == cfg.num_hidden_layers * (
        cfg.kv_lora_rank + 4 + 4 * cfg.qk_rope_head_dim
    )
    assert r["cache_bytes"][r["cache"]]["131072"]["1"] == r["cache_bytes_per_token"][r["cache"]] * 131072
    assert {"MLA float32", "MLA float16 / bfloat16", "MLA int8 + 16-bit rope", "MHA (4 KV heads), float32",
            "MQA (1 KV head), float32"} <= set(r["cache_bytes_per_token"])
    text = CliRunner().invoke(main, ["inspect", str(demo.directory)]).stdout
    row = next(line for line in text.splitlines() if line.startswith(" *"))
    assert row.split()[:6] == ["*MLA", "int8", "+", "float32", "rope", "528"]
    plan = next(line for line in text.splitlines() if line.startswith("plan"))
    assert "int8 latent cache (a float32 scale per token and layer), float32 rope cache" in plan
    assert "mla_deploy.LatentAttentionQ8" in plan


def test_eval_reports_the_int8_caches_cost_instead_of_failing_its_float_tolerance(demo, tmp_path):
    """float32 weights over an int8 latent: eval's loss differs from the float source by the cache's cost (verify
    passes it at the cache's tolerance), which eval reports as such, not as a failure of the float32 1e-4."""
    from mla_deploy.evaluate import evaluate

    text = tmp_path / "text.txt"
    text.write_text((DEMO_CHECKPOINT / "heldout.txt").read_text()[:3000])
    report = evaluate(demo.directory, text, window=128)
    assert report.lossy and report.passed and report.caches == ("int8", "float32")
    assert any(line.startswith("int8 latent and float32 rope caches against float32 ones: loss ")
               for line in report.lines())
