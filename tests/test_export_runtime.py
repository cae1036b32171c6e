"""Export + runtime against the torch source and transformers: logits, tokens, graph structure, contracts."""

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from mla_deploy.cli import main
from mla_deploy.errors import ExportError, ExportLoadError, InputError
from mla_deploy.export import ExportOptions, export
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from mla_deploy.runtime.feeds import prefill_feed
from mla_deploy.modeling import load_model
from mla_deploy.verify import verify_export
from reference import torch_greedy
from tiny import build_hf_model, save_hf_model

TOL = 1e-4
ABSORB = ["fused", "factored"]


@pytest.mark.parametrize("absorb", ABSORB)
@pytest.mark.parametrize("lengths", [(19,), (21, 12, 5, 1)], ids=["batch1", "padded-batch"])
def test_ort_matches_torch_for_prefill_and_32_decode_steps(checkpoint_dir, exported, variant, absorb, lengths):
    src, _ = checkpoint_dir(variant)
    report = verify_export(exported(variant, absorb), src, steps=32, lengths=lengths)
    assert report.logit_scale > 0.5
    assert report.prefill_max_abs < TOL, report.lines
    assert len(report.decode_max_abs) == 32 and max(report.decode_max_abs) < TOL, report.lines
    assert report.token_agreement == 1.0, report.lines


def test_cli_run_greedy_equals_transformers_generate(checkpoint_dir, exported, variant):
    _, hf = checkpoint_dir(variant)
    prompt = [5, 17, 33, 8, 61, 12, 40]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    result = CliRunner().invoke(main, ["run", str(exported(variant)), "--prompt-ids", ",".join(map(str, prompt)),
                                       "-n", "32", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output.strip().splitlines()[-1])
    stop = hf.config.eos_token_id
    expected = ref[: ref.index(stop) + 1] if stop in ref else ref
    assert out["token_ids"] == expected
    assert {"token_ids", "prefill_ms", "decode_tokens_per_s"} <= out.keys()


@pytest.mark.parametrize("absorb", ABSORB)
def test_decode_graph_caches_are_latent_and_rope_only(checkpoint_dir, exported, absorb):
    src, hf = checkpoint_dir("v3_lora_group_yarn")
    cfg = hf.config
    graph = onnx.load(exported("v3_lora_group_yarn", absorb) / "decode.onnx", load_external_data=False).graph

    def widths(values):
        return {v.name: v.type.tensor_type.shape.dim[-1].dim_value for v in values
                if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}

    inputs, outputs = widths(graph.input), widths(graph.output)
    expected_in = {**{f"past_latent.{i}": cfg.kv_lora_rank for i in range(cfg.num_hidden_layers)},
                   **{f"past_rope.{i}": cfg.qk_rope_head_dim for i in range(cfg.num_hidden_layers)}}
    assert inputs == expected_in  # the only float inputs: no decompressed K/V anywhere
    assert {k: v for k, v in outputs.items() if k != "logits"} == {
        k.replace("past", "present"): v for k, v in expected_in.items()}


def test_fused_decode_holds_fused_matrices_not_uk_uv(exported):
    graph = onnx.load(exported("v3_lora_group_yarn", "fused") / "decode.onnx", load_external_data=False).graph
    names = {t.name for t in graph.initializer}
    for i in range(3):
        assert {f"layers.{i}.attn.q_uk", f"layers.{i}.attn.uv_o"} <= names
        assert not {f"layers.{i}.attn.uk", f"layers.{i}.attn.uv", f"layers.{i}.attn.kv_b"} & names
    factored = onnx.load(exported("v3_lora_group_yarn", "factored") / "decode.onnx", load_external_data=False).graph
    names = {t.name for t in factored.initializer}
    assert {"layers.0.attn.uk", "layers.0.attn.uv"} <= names and "layers.0.attn.q_uk" not in names


def test_fused_matrices_equal_the_float64_products(checkpoint_dir, exported):
    """The stored W^Q·W^UK and W^UV·W^O are the products of the checkpoint's factors."""
    from mla_deploy.checkpoint import Checkpoint
    from mla_deploy.export.absorb import split_heads, split_kv_b

    src, _ = checkpoint_dir("v2_nolora_greedy_yarn")
    ckpt = Checkpoint(src)
    cfg = ckpt.config
    model = onnx.load(exported("v2_nolora_greedy_yarn", "fused") / "decode.onnx")
    init = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    p = "model.layers.1.self_attn."
    w_uk, w_uv = split_kv_b(cfg, ckpt.tensor(p + "kv_b_proj.weight"))
    nope, _ = split_heads(cfg, ckpt.tensor(p + "q_proj.weight"))
    h = 2
    q_uk = init["layers.1.attn.q_uk"]  # [in, h·d_c]
    expected = (w_uk[h].T.astype(np.float64) @ nope[h].astype(np.float64)).T  # [in, d_c]
    dc = cfg.kv_lora_rank
    np.testing.assert_allclose(q_uk[:, h * dc:(h + 1) * dc], expected, rtol=1e-6, atol=1e-7)
    w_o = ckpt.tensor(p + "o_proj.weight")
    uv_o = init["layers.1.attn.uv_o"]  # [h·d_c, d]
    expected = (w_o[:, h * cfg.v_head_dim:(h + 1) * cfg.v_head_dim].astype(np.float64) @ w_uv[h].astype(np.float64)).T
    np.testing.assert_allclose(uv_o[h * dc:(h + 1) * dc], expected, rtol=1e-6, atol=1e-7)


def test_moe_runs_one_branch_per_expert(checkpoint_dir, exported):
    _, hf = checkpoint_dir("v3_lora_group_yarn")
    graph = onnx.load(exported("v3_lora_group_yarn") / "decode.onnx", load_external_data=False).graph
    ifs = [n for n in graph.node if n.op_type == "If"]
    moe_layers = hf.config.num_hidden_layers - hf.config.first_k_dense_replace
    assert len(ifs) == moe_layers * hf.config.n_routed_experts
    top_level_expert_matmuls = [
        n for n in graph.node if n.op_type == "MatMul" and any(".experts." in i for i in n.input)
    ]
    assert top_level_expert_matmuls == []  # routed experts run only inside their If branch


def test_routed_experts_kernel_equals_the_branches(checkpoint_dir, exported, variant, tmp_path):
    """mla_deploy.RoutedExperts ("kernel", I = 24 and d = 64 padded to its strips), registered and as its function
    body: exact against the torch source, and the same logits as one If per expert."""
    src, hf = checkpoint_dir(variant)
    out = tmp_path / "kernel"
    result = export(src, out, ExportOptions(absorb="factored", experts="kernel"))
    counts = result.manifest["graphs"]["decode"]["op_counts"]
    if hf.config.n_routed_experts is None or hf.config.first_k_dense_replace >= hf.config.num_hidden_layers:
        assert result.manifest["experts"] in (None, "kernel") and "mla_deploy::RoutedExperts" not in counts
        return
    moe_layers = hf.config.num_hidden_layers - hf.config.first_k_dense_replace
    assert result.manifest["experts"] == "kernel" and "If" not in counts
    assert counts["mla_deploy::RoutedExperts"] == moe_layers
    report = verify_export(out, src, steps=4)
    assert report.passed, report.lines
    ids = np.random.default_rng(1).integers(3, hf.config.vocab_size, (2, 10))
    logits = {}
    for name, directory, options in (("kernel", out, RuntimeOptions()), ("body", out, RuntimeOptions(kernels=False)),
                                     ("branches", exported(variant, "factored"), RuntimeOptions())):
        model = ExportedModel(directory, options)
        logits[name] = model.run("prefill", prefill_feed(model.config, ids))["logits"]
    scale = max(1.0, np.abs(logits["branches"]).max())
    assert np.abs(logits["kernel"] - logits["branches"]).max() <= 1e-4 * scale
    assert np.abs(logits["body"] - logits["branches"]).max() <= 1e-4 * scale


@pytest.mark.parametrize("absorb", ["fused", "factored"])
def test_decode_attention_in_onnxruntimes_ops_is_exact_and_equals_the_kernel(checkpoint_dir, exported, variant, absorb,
                                                                             tmp_path):
    """The tiny models' auto choice is mla_deploy.LatentAttention (4 heads, short caches); decode_attention="ops"
    keeps onnxruntime's MatMul-Softmax-MatMul: exact against the torch source too, and the same decode logits."""
    src, hf = checkpoint_dir(variant)
    out = tmp_path / "ops"
    result = export(src, out, ExportOptions(absorb=absorb, experts="branches", decode_attention="ops"))
    assert result.manifest["decode_attention"] == "ops"
    assert "mla_deploy::LatentAttention" not in result.manifest["graphs"]["decode"]["op_counts"]
    kernel = exported(variant, absorb)
    assert ExportedModel(kernel).manifest["decode_attention"] == "kernel"
    report = verify_export(out, src, steps=4)
    assert report.passed, report.lines
    prompts = [[3, 5, 8, 13, 21], [4, 9, 2, 7]]  # rows decode the same token sequence in both: compare each step
    logits = []
    for directory in (out, kernel):
        gen = Generator(ExportedModel(directory), SamplingParams(), stop_token_ids=())
        state = gen.new_state([np.asarray(p) for p in prompts])
        gen.prefill(state, prompts)
        logits.append([gen.decode_step(state, np.array([t, t + 1])) for t in range(3, 9)])
    logits = np.stack(logits)  # [2, steps, rows, vocab]
    assert float(np.abs(logits[0] - logits[1]).max()) <= 1e-4 * max(1.0, float(np.abs(logits[1]).max()))


def test_routed_experts_stay_finite_when_every_routing_weight_is_zero(tmp_path):
    """A sigmoid router with routed_scaling_factor 0 gives every chosen expert weight exactly 0, as an underflowing
    router would: RoutedExperts sees a dispatch of zeros, and the routed experts must add nothing, exactly as in the
    torch source."""
    hf = build_hf_model("v3_nointerleave_ungrouped", routed_scaling_factor=0.0)
    src, out = tmp_path / "ckpt", tmp_path / "out"
    save_hf_model(hf, src)
    result = export(src, out, ExportOptions(absorb="factored", experts="kernel"))
    counts = result.manifest["graphs"]["decode"]["op_counts"]
    assert counts.get("mla_deploy::RoutedExperts", 0) == hf.config.num_hidden_layers
    ids = np.random.default_rng(2).integers(3, hf.config.vocab_size, (2, 9))
    model = ExportedModel(out)
    logits = model.run("prefill", prefill_feed(model.config, ids))["logits"]
    assert np.isfinite(logits).all()
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(logits - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("absorb", ["fused", "factored"])
def test_a_long_cache_is_the_a_operand_and_exact(checkpoint_dir, exported, variant, absorb, tmp_path, monkeypatch):
    """An export whose cache can outgrow LONG_CACHE_BYTES per row multiplies probs by the cache as the A operand
    (FusedMatMul transA, one per layer) in onnxruntime's ops, and its kernel op is LatentAttentionLong, whose function
    body does the same; lowered to 8 slots, both exports match the torch source, the kernel's with and without the
    library. The default tiny exports keep the plain MatMul (ops) and LatentAttention (kernel)."""
    from mla_deploy.export import plan

    def transposed_a(directory) -> int:
        decode = onnx.load(directory / "decode.onnx", load_external_data=False)
        return sum(n.op_type == "FusedMatMul" and any(a.name == "transA" and a.i == 1 for a in n.attribute)
                   for n in decode.graph.node)

    src, hf = checkpoint_dir(variant)
    assert transposed_a(exported(variant, absorb)) == 0
    assert (
        "mla_deploy::LatentAttention"
        in ExportedModel(exported(variant, absorb)).manifest["graphs"]["decode"]["op_counts"]
    )
    monkeypatch.setattr(plan, "LONG_CACHE_BYTES", 4 * hf.config.kv_lora_rank * 8)
    ops, kernel = tmp_path / "ops", tmp_path / "kernel"
    export(src, ops, ExportOptions(absorb=absorb, experts="branches", decode_attention="ops"))
    assert transposed_a(ops) == hf.config.num_hidden_layers
    result = export(src, kernel, ExportOptions(absorb=absorb, experts="branches"))
    assert (
        result.manifest["graphs"]["decode"]["op_counts"]["mla_deploy::LatentAttentionLong"]
        == hf.config.num_hidden_layers
    )
    for directory in (ops, kernel):
        report = verify_export(directory, src, steps=4)
        assert report.passed, report.lines
    prompts = [[3, 5, 8, 13, 21], [4, 9, 2, 7]]  # the long body (no library) against the kernel, step by step
    logits = []
    for options in (RuntimeOptions(), RuntimeOptions(kernels=False)):
        gen = Generator(ExportedModel(kernel, options), SamplingParams(), stop_token_ids=())
        state = gen.new_state([np.asarray(p) for p in prompts])
        gen.prefill(state, prompts)
        logits.append([gen.decode_step(state, np.array([t, t + 1])) for t in range(3, 9)])
    logits = np.stack(logits)
    assert float(np.abs(logits[0] - logits[1]).max()) <= 1e-4 * max(1.0, float(np.abs(logits[1]).max()))


@pytest.mark.parametrize("chunk", [1, 4, 9])
def test_chunked_prefill_then_decode_equals_one_shot(exported, variant, chunk):
    model = ExportedModel(exported(variant))
    prompts = [list(range(3, 30)), [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27]]
    whole = Generator(model, chunk_size=512, stop_token_ids=()).generate(prompts, 16)
    chunked = Generator(model, chunk_size=chunk, stop_token_ids=()).generate(prompts, 16)
    assert chunked.token_ids == whole.token_ids


@pytest.mark.parametrize("absorb", ABSORB)
@pytest.mark.parametrize("variant", ["v2_nolora_greedy_yarn", "v3_lora_group_yarn"])  # query from x, from c_q
def test_prefill_takes_the_cheaper_form_over_the_slots_its_queries_see(exported, variant, absorb, tmp_path):
    """Each prefill call takes the form ChunkCosts finds cheaper for its T tokens over the slots they see: a prompt
    from an empty cache the naive one, which decompresses only those slots through kv_b however large the capacity
    (onnxruntime's profiler gives the shape it made); a few tokens after a cached history the absorbed one, whose
    logits equal the decode graph's for the same tokens one at a time."""
    import onnxruntime as ort

    from mla_deploy import io_spec
    from mla_deploy.export.absorb import AbsorbMode
    from mla_deploy.export.attention import ChunkCosts

    src = exported(variant, absorb)
    model = ExportedModel(src)
    cfg = model.config
    costs = ChunkCosts.of(cfg, AbsorbMode(absorb))
    graph = onnx.load(src / "prefill.onnx", load_external_data=False)
    branch = next(n for n in graph.graph.node if n.op_type == "If")
    expand = next(n.name for a in branch.attribute for n in a.g.node if "layers.0.attn.kv_b" in n.input)
    options = model.session_options(io_spec.PREFILL)
    options.enable_profiling, options.profile_file_prefix = True, str(tmp_path / "prefill")
    session = ort.InferenceSession(str(src / "prefill.onnx"), options)

    def call(ids, written, capacity, caches=None):
        feed = prefill_feed(cfg, ids, capacity)
        if caches:
            feed.update(caches)
        t = ids.shape[1]
        feed[io_spec.WRITE_INDICES] = np.full(len(ids), written)
        feed[io_spec.POSITION_IDS] = written + np.arange(t)[None].repeat(len(ids), 0)
        return dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))

    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 40))
    assert not costs.absorbed_is_cheaper(40, 40) and costs.absorbed_is_cheaper(2, 42)
    wide = call(prompt, 0, 256)
    np.testing.assert_allclose(wide[io_spec.LOGITS], call(prompt, 0, 40)[io_spec.LOGITS], rtol=0, atol=1e-4)
    caches = {io_spec.past_of(k): v for k, v in wide.items() if k.startswith("present_")}
    after = call(np.array([[5, 6]]), 40, 256, caches)
    events = json.loads(open(session.end_profiling()).read())
    ran = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    made = [e["args"]["output_type_shape"] for e in ran if e["name"] == f"{expand}_kernel_time"]
    heads = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    assert [list(m[0].values())[0] for m in made] == [[1, 40, heads], [1, 40, heads]]  # the prompt's two calls only
    assert any("/absorbed/" in e["name"] for e in ran)

    step, logits = dict(caches), []
    for i, token in enumerate((5, 6)):
        feed = {io_spec.INPUT_IDS: np.array([[token]]), io_spec.POSITION_IDS: np.array([[40 + i]]),
                io_spec.ATTENTION_MASK: np.ones((1, 256), np.int64), io_spec.WRITE_INDICES: np.array([40 + i]), **step}
        out = model.run(io_spec.DECODE, feed)
        logits.append(out[io_spec.LOGITS][:, 0])
        step = {io_spec.past_of(k): v for k, v in out.items() if k.startswith("present_")}
    np.testing.assert_allclose(after[io_spec.LOGITS][0], np.concatenate(logits), rtol=0, atol=1e-4)


def test_prefill_attention_naive_leaves_the_absorbed_form_out_of_the_prefill_graph(checkpoint_dir, tmp_path):
    """`--prefill-attention naive`: no If, none of the absorbed weights in the prefill graph (a GPU session holds a
    copy of every weight its graph reads), verified like the default."""
    src, _ = checkpoint_dir("v2_nolora_greedy_yarn")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(src), "-o", str(out), "--prefill-attention", "naive"])
    assert result.exit_code == 0 and "PASS" in result.output, result.output
    assert json.loads((out / "manifest.json").read_text())["prefill_attention"] == "naive"
    graph = onnx.load(out / "prefill.onnx", load_external_data=False).graph
    assert not [n for n in graph.node if n.op_type == "If"]
    assert not [i.name for i in graph.initializer if i.name.split(".")[-1] in ("uk", "uv", "q_nope", "q_rope")]


def test_batched_rows_equal_rows_alone(exported, variant):
    model = ExportedModel(exported(variant))
    prompts = [[4, 8, 15, 16, 23, 42], [3], [50, 60, 70, 80, 90, 11, 12, 13, 14]]
    batch = Generator(model, stop_token_ids=()).generate(prompts, 12)
    for row, prompt in zip(batch.token_ids, prompts):
        assert Generator(model, stop_token_ids=()).generate([prompt], 12).token_ids[0] == row


def test_decode_only_model_prefills_through_the_decode_graph(exported, variant):
    """Loaded without its prefill graph (one prepacked copy of the weights), a model feeds prompts through the decode
    graph a position at a time, rows of different lengths together: the same last-token logits and tokens."""
    both = ExportedModel(exported(variant))
    decode_only = ExportedModel(exported(variant), graphs=("decode",))
    assert set(decode_only.sessions) == {"decode"}
    prompts = [[4, 8, 15, 16, 23, 42], [3], [50, 60, 70, 80, 90, 11, 12, 13, 14]]
    logits = []
    for model in (both, decode_only):
        gen = Generator(model, stop_token_ids=())
        logits.append(gen.prefill(gen.new_state([np.asarray(p) for p in prompts]), prompts))
    assert np.abs(logits[0] - logits[1]).max() <= 1e-4 * max(1.0, np.abs(logits[0]).max())
    assert (Generator(decode_only, stop_token_ids=()).generate(prompts, 12).token_ids
            == Generator(both, stop_token_ids=()).generate(prompts, 12).token_ids)


def test_cli_run_decode_only_and_the_scheduler_refusing_it(exported):
    from mla_deploy.runtime.scheduler import Scheduler

    out = exported("v3_dense_tied")
    args = ["run", str(out), "--prompt-ids", "5,6,7,8", "-n", "6", "--json"]
    both, alone = (json.loads(CliRunner().invoke(main, args + extra).stdout) for extra in ([], ["--decode-only"]))
    assert alone["token_ids"] == both["token_ids"]
    with pytest.raises(InputError, match="prefill graph: load the model with both graphs"):
        Scheduler(ExportedModel(out, graphs=("decode",)))


def test_cache_grows_past_a_block_without_changing_tokens(exported, monkeypatch):
    from mla_deploy.runtime import cache

    model = ExportedModel(exported("v2_group_limited"))
    big = Generator(model, stop_token_ids=()).generate([[5, 6, 7]], 40)
    monkeypatch.setattr(cache, "BLOCK", 8)  # forces five grows during this generation
    small = Generator(model, stop_token_ids=()).generate([[5, 6, 7]], 40)
    assert small.token_ids == big.token_ids


def test_manifest_describes_the_export(checkpoint_dir, exported):
    src, hf = checkpoint_dir("v3_lora_group_yarn")
    out = exported("v3_lora_group_yarn", "fused")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["absorb"] == "fused" and manifest["dtype"] == "float32" and manifest["opset"] == 24
    assert manifest["max_seq_len"] == hf.config.max_position_embeddings
    assert manifest["config"]["kv_lora_rank"] == hf.config.kv_lora_rank
    assert len(manifest["source"]["sha256"]) == 64 and manifest["mla_deploy_version"]
    decode_inputs = {i["name"]: i for i in manifest["graphs"]["decode"]["inputs"]}
    assert decode_inputs["past_latent.0"]["shape"] == ["batch", "capacity", hf.config.kv_lora_rank]
    model = onnx.load(out / "decode.onnx", load_external_data=False)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["producer"] == "mla-deploy" and meta["export_id"] == manifest["export_id"]
    assert manifest["tokenizer"] == ["generation_config.json"]  # save_pretrained wrote no tokenizer
    assert sorted(p.name for p in out.iterdir()) == ["decode.onnx", "generation_config.json", "manifest.json",
                                                     "prefill.onnx", "verify.onnx", "weights.bin"]
    assert manifest["draft"] is False and "draft" not in manifest["graphs"]  # no MTP layer in this checkpoint


def test_weights_shared_between_graphs_stored_once(exported):
    out = exported("v3_lora_group_yarn", "fused")
    graphs = [onnx.load(out / f, load_external_data=False).graph for f in ("prefill.onnx", "decode.onnx")]
    sizes = [{t.name: int(np.prod(t.dims)) * 4 for t in g.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
             for g in graphs]
    shared = sizes[0].keys() & sizes[1].keys()
    assert {"embed", "lm_head", "layers.1.moe.experts.0.gate_up"} <= shared
    union = {**sizes[0], **sizes[1]}
    stored = json.loads((out / "manifest.json").read_text())["weights"]["bytes"]
    assert sum(union.values()) <= stored < sum(union.values()) + 64 * len(union)  # each tensor once, 64-byte aligned
    assert stored < sum(sizes[0].values()) + sum(sizes[1].values())


def test_failed_verification_leaves_nothing(checkpoint_dir, tmp_path):
    src, _ = checkpoint_dir("v2_group_limited")
    out = tmp_path / "out"

    def failing(_):
        raise ExportError("verification failed on purpose")

    with pytest.raises(ExportError, match="on purpose"):
        export(src, out, ExportOptions(), verify=failing)
    assert list(tmp_path.iterdir()) == []


def test_context_length_guard(checkpoint_dir, tmp_path):
    src, _ = checkpoint_dir("v2_group_limited")
    out = tmp_path / "short"
    export(src, out, ExportOptions(max_seq_len=24))
    gen = Generator(ExportedModel(out), stop_token_ids=())
    prompt = list(range(3, 23))
    with pytest.raises(
        InputError, match="20 prompt tokens \\+ 5 new tokens = 25 exceeds the export's maximum length 24"
    ):
        gen.generate([prompt], 5)
    at_limit = gen.generate([prompt], 4).token_ids[0]  # exactly the maximum length: every token, and right
    assert at_limit == torch_greedy(load_model(src), prompt, 4)


def test_graphs_from_different_exports_refused(exported, tmp_path):
    a, b = exported("v3_lora_group_yarn", "fused"), exported("v3_lora_group_yarn", "factored")
    mixed = tmp_path / "mixed"
    shutil.copytree(a, mixed)
    shutil.copyfile(b / "decode.onnx", mixed / "decode.onnx")
    with pytest.raises(ExportLoadError, match="decode.onnx: does not match the manifest"):
        ExportedModel(mixed)
    manifest = json.loads((mixed / "manifest.json").read_text())
    import hashlib

    manifest["graphs"]["decode"]["sha256"] = hashlib.sha256((mixed / "decode.onnx").read_bytes()).hexdigest()
    (mixed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportLoadError, match="graphs from different exports cannot be mixed"):
        ExportedModel(mixed)


def test_cuda_request_without_cuda_falls_back_with_message(exported):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    with pytest.warns(RuntimeWarning, match="CUDAExecutionProvider.*not available.*falling back to CPU"):
        model = ExportedModel(exported("v2_group_limited"), RuntimeOptions(provider="cuda"))
    assert model.device == "cpu"


def test_session_config_entries_reach_both_sessions_and_win(exported):
    out = exported("v2_group_limited")
    entries = (("session.inter_op.allow_spinning", "1"), ("session.intra_op.allow_spinning", "1"))
    model = ExportedModel(out, RuntimeOptions(spin=False, session_config=entries))  # spin=False sets "0" first
    for session in model.sessions.values():
        options = session.get_session_options()
        assert [options.get_session_config_entry(key) for key, _ in entries] == ["1", "1"]
    stops = [s.get_session_options().get_session_config_entry("session.force_spinning_stop")
             for s in ExportedModel(out).sessions.values()]
    assert stops == ["1", "1"]  # threads stop spinning when a run ends: an idle session takes no core from the other
    kept = ExportedModel(out, RuntimeOptions(session_config=(("session.force_spinning_stop", "0"),)))
    assert [s.get_session_options().get_session_config_entry("session.force_spinning_stop")
            for s in kept.sessions.values()] == ["0", "0"]
    for bad in [("session.inter_op.allow_spinning", 1)], [("session.inter_op.allow_spinning",)], [("", "1")]:
        with pytest.raises(InputError, match=r"session_config entry .*: expected a \(key, value\) pair"):
            ExportedModel(out, RuntimeOptions(session_config=tuple(bad)))
    # onnxruntime takes any key and ignores one it does not know: a key without its area is named
    with pytest.raises(InputError, match=r"^session_config key 'intra_op.allow_spinning': not an onnxruntime session "
                                         r"option; their keys begin with session\., optimization\., mlas\., ep\.$"):
        ExportedModel(out, RuntimeOptions(session_config=(("intra_op.allow_spinning", "0"),)))


def test_runtime_options_are_checked_before_any_session(exported):
    """A negative thread count or a string where a flag belongs ("false" is true to Python) is named, not passed to
    onnxruntime (which refuses -1 with an error about its thread pool, or reads the flag wrongly)."""
    out = exported("v2_group_limited")
    for bad, message in ((dict(threads=-1), "threads=-1: expected an integer >= 0"),
                         (dict(threads=1.5), "threads=1.5"), (dict(threads=True), "threads=True"),
                         (dict(log_severity=7), "log_severity=7"), (dict(spin="false"), "spin='false'"),
                         (dict(prepack="false"), "prepack='false': expected True, False or None"),
                         (dict(check_weights="all"), "check_weights='all'")):
        with pytest.raises(InputError, match=re.escape(message)):
            ExportedModel(out, RuntimeOptions(**bad))
    assert ExportedModel(out, RuntimeOptions(threads=np.int64(1), prepack=None)).options.threads == 1


def test_runtime_imports_and_generates_without_torch(exported):
    out = exported("v2_group_limited")
    code = (
        "import sys\n"
        "from mla_deploy.runtime import ExportedModel, Generator\n"
        f"r = Generator(ExportedModel({str(out)!r})).generate([[5, 6, 7]], 4)\n"
        "assert len(r.token_ids[0]) >= 1\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_cache_update_is_in_place(exported, capfd):
    """onnxruntime warns when TensorScatter copies the cache instead of writing into the bound buffer."""
    out = exported("v3_lora_group_yarn", "fused")
    for kind in ("prefill.onnx", "decode.onnx"):
        graph = onnx.load(out / kind, load_external_data=False).graph
        producers = {o: n.op_type for n in graph.node for o in n.output}
        assert all(producers[f"present_{c}.{i}"] == "TensorScatter" for c in ("latent", "rope") for i in range(3))
    model = ExportedModel(out, RuntimeOptions(log_severity=1))
    capfd.readouterr()
    Generator(model, stop_token_ids=()).generate([[5, 6, 7], [8, 9]], 6)
    assert "in-place optimization not activated" not in capfd.readouterr().err
