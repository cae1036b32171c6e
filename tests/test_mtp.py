"""DeepSeek-V3's multi-token-prediction layer: loaded by the source model as transformers' own pieces compute it,
exported as the draft graph (checked against the torch module), and chained by the runtime as a draft whose greedy
output is plain decoding's."""

import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from mla_deploy import io_spec
from mla_deploy.checkpoint import Checkpoint
from mla_deploy.export import ExportOptions, export
from mla_deploy.modeling import LayerCache, load_model, load_mtp, new_caches
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime import draft as draft_module
from mla_deploy.runtime.speculative import DraftPolicy, Speculation
from mla_deploy.verify import verify_export
from tiny import add_mtp_layer, build_hf_model, save_hf_model

VARIANTS = ("v3_lora_group_yarn", "v3_nointerleave_ungrouped")


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """variant -> (directory, transformers model, reference MTP of transformers' pieces)."""
    built = {}

    def get(variant: str):
        if variant not in built:
            model = build_hf_model(variant)
            directory = tmp_path_factory.mktemp(f"mtp-{variant}")
            save_hf_model(model, directory)
            built[variant] = (directory, model, add_mtp_layer(model, directory))
        return built[variant]

    return get


@pytest.fixture(scope="module")
def mtp_export(mtp_checkpoint, tmp_path_factory):
    exports = {}

    def get(variant: str = VARIANTS[0], **options):
        key = (variant, tuple(sorted(options.items())))
        if key not in exports:
            out = tmp_path_factory.mktemp("mtp-export") / "out"
            export(mtp_checkpoint(variant)[0], out, ExportOptions(experts="branches", **options))
            exports[key] = out
        return exports[key]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
def test_source_mtp_is_transformers_pieces_in_deepseeks_order(mtp_checkpoint, variant):
    """modeling.mtp on the main model's final hidden states equals the module built of transformers' own
    DeepseekV3 layers, norms and linears (enorm on the embedding first, hnorm on the hidden state after the main
    model's final norm); with the halves swapped the logits differ, so the comparison can tell the order."""
    directory, hf, reference = mtp_checkpoint(variant)
    ids = torch.randint(3, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    b, t = ids.shape
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state  # after the final norm
        rope = hf.model.rotary_emb(h, torch.arange(t - 1)[None])
        expected = hf.lm_head(reference(hf.model.embed_tokens(ids[:, 1:]), h[:, :-1], rope))
        swapped = reference.eh_proj.weight.roll(hf.config.hidden_size, dims=1)
        original = reference.eh_proj.weight.clone()
        reference.eh_proj.weight.copy_(swapped)
        wrong_order = hf.lm_head(reference(hf.model.embed_tokens(ids[:, 1:]), h[:, :-1], rope))
        reference.eh_proj.weight.copy_(original)
    main, draft = load_model(directory), load_mtp(directory)
    _, hidden = main.logits_and_hidden(ids, torch.arange(t)[None].expand(b, -1), new_caches(main.cfg, b, t),
                                       torch.zeros(b, dtype=torch.long), torch.ones(b, t), "naive")
    assert (hidden - h).abs().max() < 1e-4
    for form in ("naive", "absorbed"):
        cache = LayerCache(torch.zeros(b, t, main.cfg.kv_lora_rank), torch.zeros(b, t, main.cfg.qk_rope_head_dim))
        logits, _ = draft(ids[:, 1:], hidden[:, :-1], torch.arange(t - 1)[None].expand(b, -1), cache,
                          torch.zeros(b, dtype=torch.long), torch.ones(b, t), form)
        assert (logits - expected).abs().max() < 1e-4 * max(1.0, expected.abs().max().item())
    assert (wrong_order - expected).abs().max() > 0.1


def test_transformers_still_loads_a_checkpoint_with_an_mtp_layer(mtp_checkpoint):
    """DeepseekV3ForCausalLM leaves layer num_hidden_layers aside (unexpected keys) and computes what the main model
    computes."""
    from transformers import AutoModelForCausalLM

    directory, hf, _ = mtp_checkpoint(VARIANTS[0])
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(3, hf.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, hf(ids).logits)


def test_export_writes_the_draft_graph_sharing_the_embedding_and_head(mtp_export):
    out = mtp_export()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["draft"] is True and manifest["graphs"]["draft"]["file"] == "draft.onnx"
    inputs = {i["name"]: i["shape"] for i in manifest["graphs"]["draft"]["inputs"]}
    layer = manifest["config"]["num_hidden_layers"]
    assert inputs[io_spec.PREVIOUS_HIDDEN] == ["batch", "seq", manifest["config"]["hidden_size"]]
    assert set(inputs) >= {f"past_latent.{layer}", f"past_rope.{layer}"} and "past_latent.0" not in inputs

    def external(name):
        return {t.name for t in onnx.load(out / name, load_external_data=False).graph.initializer
                if t.data_location == onnx.TensorProto.EXTERNAL}

    draft, decode = external("draft.onnx"), external("decode.onnx")
    assert {"embed", "lm_head"} <= draft & decode  # one copy in weights.bin, read by both
    assert f"layers.{layer}.eh_proj" in draft and not any(n.startswith("layers.0.") for n in draft)


@pytest.mark.parametrize("options", [{}, {"absorb": "fused"}, {"dtype": "bfloat16"}, {"quantize": "int4"}],
                         ids=["float32", "fused", "bfloat16", "int4"])
def test_verify_checks_the_draft_graph_against_the_torch_module(mtp_export, mtp_checkpoint, options):
    report = verify_export(mtp_export(**options), mtp_checkpoint(VARIANTS[0])[0], steps=4)
    assert report.passed, report.lines
    (line,) = [x for x in report.lines if x.startswith("draft")]
    assert "pairs in one chunk" in line and "chained one more token" in line
    assert any(x.startswith("verify   4 tokens in one pass") for x in report.lines)


def test_verify_of_a_single_step_checks_the_draft_without_a_chained_token(mtp_export, mtp_checkpoint):
    """`--steps 1` generates one token: the draft's chunk is checked, and there is no second token to chain."""
    report = verify_export(mtp_export(), mtp_checkpoint(VARIANTS[0])[0], steps=1)
    assert report.passed, report.lines
    (line,) = [x for x in report.lines if x.startswith("draft")]
    assert "pairs in one chunk" in line and "chained" not in line
    assert any(x.startswith("verify   1 token in one pass") for x in report.lines)


def test_a_broken_draft_graph_fails_verification(mtp_export, mtp_checkpoint, tmp_path):
    """The draft check can fail: the same export verified against a checkpoint whose MTP enorm differs (the graph's
    weights no longer the source's) fails on the draft line alone."""
    src = tmp_path / "ckpt"
    shutil.copytree(mtp_checkpoint(VARIANTS[0])[0], src)
    from mla_deploy.safetensors_io import SafetensorsFile, write_safetensors

    f = SafetensorsFile(src / "model.safetensors")
    state = {n: f.float32(n) for n in f.entries}
    del f
    layer = Checkpoint(src).config.num_hidden_layers
    state[f"model.layers.{layer}.enorm.weight"] = state[f"model.layers.{layer}.enorm.weight"] * 1.5
    write_safetensors(src / "model.safetensors", state)
    out = tmp_path / "out"
    shutil.copytree(mtp_export(), out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["source"]["sha256"] = Checkpoint(src).content_hash()  # pretend this is the source
    (out / "manifest.json").write_text(json.dumps(manifest))
    report = verify_export(out, src, steps=2)
    assert not report.passed
    draft_line = next(x for x in report.lines if x.startswith("draft"))
    assert float(draft_line.split("max |Δlogit| ")[1].split(";")[0]) > report.tolerance


@pytest.fixture
def always_draft(monkeypatch):
    monkeypatch.setattr(DraftPolicy, "lengths",
                        lambda self, acc, avail: [0 if a is None else n for a, n in zip(acc, avail)])


PROMPTS = [[5, 9, 3, 7, 5, 9, 3, 7, 5, 9], list(range(3, 40)), [2, 3, 2, 3, 2, 3, 2], [60, 61]]


DTYPES = {"float32": {}, "float16": {"dtype": "float16"}, "bfloat16": {"dtype": "bfloat16"},
          "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"}}


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_tokens_with_lookup_and_the_mtp_draft_are_plain_decodings_in_every_dtype(mtp_export, always_draft,
                                                                                        dtype):
    """Every dtype an export takes: its verification passes (the verify graph) and drafts change no greedy token of
    its plain decoding (the decode graph), for each prompt alone and all of them in one batch."""
    model = ExportedModel(mtp_export(**DTYPES[dtype]))
    plain = Generator(model, SamplingParams(), stop_token_ids=()).generate(PROMPTS, 20).token_ids
    for mode, k in (("mtp", 1), ("mtp", 3), ("lookup", 4)):
        spec = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation(mode, k, min_ngram=1))
        result = spec.generate(PROMPTS, 20)
        assert result.token_ids == plain and result.speculation.proposed > 0, (mode, k)
        for prompt, tokens in zip(PROMPTS, plain):
            assert spec.generate([prompt], 20).token_ids == [tokens], (mode, k)


def test_the_draft_cache_holds_the_committed_pairs_only(mtp_export, mtp_checkpoint, always_draft, monkeypatch):
    """After a generation with rejected drafts, the draft's cache rows up to the last committed position equal the
    torch MTP module's over the committed sequence: the pairs of rejected drafts left nothing behind."""
    drafters = []
    original = draft_module.MTPDrafter.__init__

    def keep(self, *args, **kwargs):
        original(self, *args, **kwargs)
        drafters.append(self)

    monkeypatch.setattr(draft_module.MTPDrafter, "__init__", keep)
    model = ExportedModel(mtp_export())
    prompt = [5, 9, 3, 7, 5, 9, 3]
    result = Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation("mtp", 3)).generate(
        [prompt], 12)
    assert result.speculation.accepted < result.speculation.proposed  # some drafts were rejected
    sequence = prompt + result.token_ids[0]
    n = len(sequence) - 1  # committed pairs (h_i, t_{i+1}) for i < n
    directory = mtp_checkpoint(VARIANTS[0])[0]
    main, draft = load_model(directory), load_mtp(directory)
    ids = torch.tensor([sequence])
    _, hidden = main.logits_and_hidden(ids, torch.arange(n + 1)[None], new_caches(main.cfg, 1, n + 1),
                                       torch.zeros(1, dtype=torch.long), torch.ones(1, n + 1), "naive")
    cache = LayerCache(torch.zeros(1, n, main.cfg.kv_lora_rank), torch.zeros(1, n, main.cfg.qk_rope_head_dim))
    draft(ids[:, 1:], hidden[:, :-1], torch.arange(n)[None], cache, torch.zeros(1, dtype=torch.long), torch.ones(1, n))
    layer = model.config.num_hidden_layers
    held = drafters[0].caches.arrays
    # the last step's pairs wait for the next catch-up; every one before it is in place
    written = drafters[0].written[0]
    assert written >= n - 4
    assert np.abs(held[io_spec.past_latent(layer)][0, :written] - cache.latent[0, :written].numpy()).max() < 1e-4
    assert np.abs(held[io_spec.past_rope(layer)][0, :written] - cache.rope[0, :written].numpy()).max() < 1e-4


def test_a_seeded_sampled_generation_is_the_same_with_the_mtp_draft(mtp_export, always_draft):
    """The draft proposes its argmax (a deterministic proposal) and acceptance draws once per emitted token from the
    row's generator: a seeded generation at temperature 1 is the one without speculation."""
    model = ExportedModel(mtp_export())
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=4)
    spec = Generator(model, params, stop_token_ids=(), speculation=Speculation("mtp", 3))
    for prompt in PROMPTS:
        plain = Generator(model, params, stop_token_ids=()).generate([prompt], 16).token_ids
        result = spec.generate([prompt], 16)
        assert result.token_ids == plain and result.speculation.proposed > 0


def test_no_draft_leaves_the_draft_graph_out(mtp_checkpoint, tmp_path):
    from click.testing import CliRunner

    from mla_deploy.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", str(mtp_checkpoint(VARIANTS[0])[0]), "-o", str(out), "--no-draft",
                                       "--no-verify", "--experts", "branches"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["draft"] is False and "draft" not in manifest["graphs"] and not (out / "draft.onnx").exists()
    assert (out / "verify.onnx").exists()
