"""The contracts nothing else pinned down: stop tokens, the graphs' attention_mask, cache growth inside a
chunked prefill, rows at very different lengths up to the export's limit, YaRN with mscale != mscale_all_dim,
the CLI's streams, verify/eval failing a wrong export, `--absorb auto` choosing fused, streamed text."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mla_deploy import io_spec
from mla_deploy.checkpoint import Checkpoint
from mla_deploy.cli import main
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.errors import ExportError
from mla_deploy.export import ExportOptions, export
from mla_deploy.export.absorb import AbsorbMode, resolve_absorb
from mla_deploy.modeling import AttentionForm, load_model, new_caches
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams, TextStream, Tokenizer
from mla_deploy.runtime.complete import complete
from mla_deploy.runtime.feeds import empty_caches
from mla_deploy.verify import greedy_agreement, verify_export
from reference import torch_greedy
from tiny import build_hf_model, save_hf_model

VARIANT = "v3_lora_group_yarn"


@pytest.fixture(scope="module")
def model(exported):
    return ExportedModel(exported(VARIANT))


# ---- stop tokens ----
def test_one_row_stopping_early_leaves_the_others_untouched(model):
    prompts = [[5, 6, 7], [40, 41, 42, 43]]
    free = Generator(model, stop_token_ids=()).generate(prompts, 12).token_ids
    stop = free[0][3]
    assert stop not in free[1] and stop not in free[0][:3], "pick prompts whose rows differ"
    gen = Generator(model, stop_token_ids=[stop])
    steps = list(gen.stream(prompts, 12))
    assert [s.step for s in steps] == list(range(12))  # 0: the token sampled from the prefill logits
    assert [s.tokens[0] for s in steps] == free[0][:4] + [None] * 8  # the stop token is emitted, then None
    assert [s.tokens[1] for s in steps] == free[1]
    result = gen.generate(prompts, 12)
    assert result.token_ids == [free[0][:4], free[1]]
    assert result.finish_reasons == ["stop", "length"]


def test_generation_ends_when_every_row_stopped(model):
    free = Generator(model, stop_token_ids=()).generate([[5, 6, 7]], 10).token_ids[0]
    steps = list(Generator(model, stop_token_ids=[free[2]]).stream([[5, 6, 7]], 10))
    assert [s.tokens for s in steps] == [[t] for t in free[: free.index(free[2]) + 1]]


def test_default_stop_tokens_are_the_configs_eos(model):
    assert Generator(model).stop_token_ids == set(model.config.eos_token_id) == {2}


# ---- the graphs' attention_mask (left padding) ----
@pytest.mark.parametrize("absorb", ["fused", "factored"])
def test_masked_slots_in_the_graphs_match_the_torch_source(checkpoint_dir, exported, absorb):
    """Left-padded rows: mask 0 on the holes, positions counted from each row's first real token."""
    src, _ = checkpoint_dir(VARIANT)
    model = ExportedModel(exported(VARIANT, absorb))
    torch_model = load_model(src)
    cfg, lengths, steps = model.config, [11, 6, 2], 4
    b, t = len(lengths), max(lengths)
    capacity = t + steps
    rng = np.random.default_rng(0)
    ids = np.zeros((b, t), np.int64)
    mask = np.zeros((b, capacity), np.int64)
    for r, n in enumerate(lengths):
        ids[r, t - n:] = rng.integers(3, cfg.vocab_size, n)
        mask[r, t - n:] = 1  # the decode slots are unmasked as they are written
    mask[:, t:] = 1
    pos = np.clip(np.cumsum(mask[:, :t], -1) - 1, 0, None)  # [b, t]
    feed = {io_spec.INPUT_IDS: ids, io_spec.POSITION_IDS: pos, io_spec.ATTENTION_MASK: mask,
            io_spec.WRITE_INDICES: np.zeros(b, np.int64), io_spec.LOGITS_POSITIONS: np.tile(np.arange(t), (b, 1)),
            **empty_caches(cfg, b, capacity)}
    out = model.run(io_spec.PREFILL, feed)
    caches = new_caches(cfg, b, capacity)
    ref = torch_model(torch.from_numpy(ids), torch.from_numpy(pos), caches, torch.zeros(b, dtype=torch.long),
                      torch.from_numpy(mask), form=AttentionForm.NAIVE).numpy()
    real = mask[:, :t].astype(bool)
    assert np.abs(out[io_spec.LOGITS] - ref)[real].max() < 1e-4
    logits = ref[:, -1]
    for step in range(steps):
        token = logits.argmax(-1)[:, None]
        slot = np.full(b, t + step)
        position = pos[:, -1:] + 1 + step
        ref_step = torch_model(torch.from_numpy(token), torch.from_numpy(position), caches, torch.from_numpy(slot),
                               torch.from_numpy(mask), form=AttentionForm.ABSORBED).numpy()[:, 0]
        feed = {io_spec.INPUT_IDS: token, io_spec.POSITION_IDS: position, io_spec.ATTENTION_MASK: mask,
                io_spec.WRITE_INDICES: slot,
                **{io_spec.past_of(k): v for k, v in out.items() if k.startswith("present_")}}
        out = model.run(io_spec.DECODE, feed)
        assert np.abs(out[io_spec.LOGITS][:, 0] - ref_step).max() < 1e-4, f"decode step {step}"
        logits = ref_step
    unmasked = dict(feed, **{io_spec.ATTENTION_MASK: np.ones_like(mask)})
    assert np.abs(model.run(io_spec.DECODE, unmasked)[io_spec.LOGITS] - out[io_spec.LOGITS]).max() > 1e-3  # it matters


# ---- cache growth, lengths, the limit ----
@pytest.mark.parametrize("resident", [False, True])
def test_cache_grows_inside_a_chunked_prefill_and_across_decode_blocks(checkpoint_dir, model, monkeypatch, resident):
    """Caches start at one slot (the Generator normally sizes them for the prompt), so every 12-token prefill
    chunk must grow them, and decode grows them again every 8 slots. Resident caches (onnxruntime's allocations,
    a device's) carry their entries over each growth the same."""
    from mla_deploy.runtime import cache

    model = ExportedModel(model.directory, RuntimeOptions(resident_caches=resident))

    src, _ = checkpoint_dir(VARIANT)
    monkeypatch.setattr(cache, "BLOCK", 8)
    real_init, real_ensure = cache.CacheBuffers.__init__, cache.CacheBuffers.ensure
    capacities = []

    def tiny_start(self, cfg, batch, capacity, max_capacity, device="cpu", dtype="float32", **options):
        real_init(self, cfg, batch, 1, max_capacity, device, dtype, **options)

    def recording(self, needed):
        grew = real_ensure(self, needed)
        capacities.append(self.capacity)
        return grew

    monkeypatch.setattr(cache.CacheBuffers, "__init__", tiny_start)
    monkeypatch.setattr(cache.CacheBuffers, "ensure", recording)
    prompt = list(range(3, 48))  # 45 tokens: chunks end at 12, 24, 36, 45
    got = Generator(model, chunk_size=12, stop_token_ids=()).generate([prompt], 20).token_ids[0]
    assert capacities[:5] == [8, 16, 24, 40, 48]  # one slot at first, then grown by every prefill chunk
    assert sorted(set(capacities[5:])) == [48, 56, 64]  # and by decode, block by block
    assert got == torch_greedy(load_model(src), prompt, 20)


@pytest.fixture(scope="module")
def short_export(checkpoint_dir, tmp_path_factory):
    src, _ = checkpoint_dir("v2_nolora_greedy_yarn")
    out = tmp_path_factory.mktemp("short") / "export"
    export(src, out, ExportOptions(max_seq_len=64, absorb="factored"))
    return src, ExportedModel(out)


def test_rows_of_very_different_lengths_up_to_the_limit_match_torch(short_export):
    src, model = short_export
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 97, n).tolist() for n in (58, 1, 29, 7)]
    result = Generator(model, chunk_size=16, stop_token_ids=()).generate(prompts, 6)  # row 0 ends at slot 63 of 64
    torch_model = load_model(src)
    assert len(result.token_ids) == 4
    for prompt, got in zip(prompts, result.token_ids, strict=True):
        assert got == torch_greedy(torch_model, prompt, 6)


# ---- YaRN with mscale != mscale_all_dim ----
YARN_UNEQUAL = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0}


@pytest.mark.parametrize("base", ["v2_nolora_greedy_yarn", "v3_lora_group_yarn"])
def test_yarn_with_unequal_mscales_matches_transformers_and_exports(tmp_path, base):
    from mla_deploy import rope

    hf = build_hf_model(base, rope_parameters=YARN_UNEQUAL)
    save_hf_model(hf, tmp_path / "ckpt")
    cfg = Checkpoint(tmp_path / "ckpt").config
    assert rope.attention_factor(cfg) != 1.0 and rope.softmax_scale(cfg) != cfg.qk_head_dim ** -0.5
    ours = load_model(tmp_path / "ckpt")
    ids = torch.randint(3, cfg.vocab_size, (2, 70), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids, torch.arange(70)[None].expand(2, -1), new_caches(cfg, 2, 70), torch.zeros(2, dtype=torch.long),
               torch.ones(2, 70))
    assert (got - ref).abs().max().item() < 1e-4
    export(tmp_path / "ckpt", tmp_path / "out")
    report = verify_export(tmp_path / "out", tmp_path / "ckpt", steps=8, lengths=(40, 9))
    assert report.passed, report.lines


# ---- no shared experts ----
@pytest.mark.parametrize("base", ["v2_nolora_greedy_yarn", "v3_lora_group_yarn"])
def test_no_shared_experts_reads_transformers_empty_tensors_and_matches_it(tmp_path, base):
    """n_shared_experts 0: transformers still saves each MoE layer's shared_experts, as [0, d] tensors (no weights):
    read as nothing, not refused as unexpected."""
    hf = build_hf_model(base, n_shared_experts=0)
    save_hf_model(hf, tmp_path / "ckpt")
    from mla_deploy.safetensors_io import SafetensorsFile

    saved = SafetensorsFile(tmp_path / "ckpt" / "model.safetensors").entries
    assert [n for n in saved if "shared_experts" in n and 0 in saved[n][1]]
    ckpt = Checkpoint(tmp_path / "ckpt")
    assert not [n for n in ckpt.names() if "shared_experts" in n]
    ours = load_model(ckpt)
    cfg = ckpt.config
    ids = torch.randint(3, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids, torch.arange(24)[None], new_caches(cfg, 1, 24), torch.zeros(1, dtype=torch.long), torch.ones(1, 24))
    assert (got - ref).abs().max().item() < 1e-4


# ---- absorb auto ----
def test_absorb_auto_picks_fused_when_the_latent_is_narrower_than_the_heads(tmp_path):
    hf = build_hf_model("v3_dense_tied", kv_lora_rank=8)  # d_c 8 < d_nope 16: the fused matrices are smaller
    save_hf_model(hf, tmp_path / "ckpt")
    cfg = Checkpoint(tmp_path / "ckpt").config
    assert resolve_absorb(cfg, "auto") == AbsorbMode.FUSED
    result = export(tmp_path / "ckpt", tmp_path / "out")
    assert result.plan.absorb == AbsorbMode.FUSED and result.manifest["absorb"] == "fused"
    assert verify_export(tmp_path / "out", tmp_path / "ckpt", steps=4).passed


def test_absorb_auto_picks_factored_for_deepseek_shapes(checkpoint_dir):
    src, _ = checkpoint_dir(VARIANT)  # d_c 32 > d_nope 16, as in DeepSeek (512 > 128)
    assert resolve_absorb(Checkpoint(src).config, "auto") == AbsorbMode.FACTORED


# ---- the CLI's streams ----
def test_run_json_is_one_object_on_stdout_and_nothing_on_stderr(exported):
    result = CliRunner().invoke(main, ["run", str(exported(VARIANT)), "--prompt-ids", "5,6,7", "-n", "5", "--json"])
    assert result.exit_code == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {
        "prompt_ids",
        "token_ids",
        "finish_reason",
        "prefill_ms",
        "decode_tokens_per_s",
        "total_ms",
        "load",
        "speculation",
    }
    assert out["load"]["seconds"] > 0 and set(out["load"]["memory"]) == {"rss", "pss", "anonymous", "file"}
    assert 0 < out["load"]["memory"]["pss"] <= out["load"]["memory"]["rss"]
    assert out["prompt_ids"] == [5, 6, 7] and len(out["token_ids"]) <= 5
    spec = out["speculation"]  # auto: prompt lookup, as the export has a verify graph and no draft graph
    assert spec["mode"] == "lookup" and spec["draft_tokens"] == 4 and 0 <= spec["accepted"] <= spec["proposed"]
    assert all(isinstance(t, int) for t in out["token_ids"]) and out["finish_reason"] in ("stop", "length")
    assert all(isinstance(out[k], float) and out[k] >= 0 for k in ("prefill_ms", "decode_tokens_per_s", "total_ms"))


def test_errors_go_to_stderr_alone(exported):
    result = CliRunner().invoke(main, ["run", str(exported(VARIANT)), "--prompt-ids", "5,999", "--json"])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.strip()] and result.stderr.startswith("error: ")


# ---- verify and eval fail a wrong export ----
@pytest.fixture(scope="module")
def wrong_demo_export(tmp_path_factory):
    """The demo model exported by a broken exporter (softmax scale off by 10 %), not verified."""
    from mla_deploy.export import attention

    out = tmp_path_factory.mktemp("wrong") / "export"
    real = attention.rope_math.softmax_scale
    attention.rope_math.softmax_scale = lambda cfg: real(cfg) * 1.1
    try:
        export(DEMO_CHECKPOINT, out)
    finally:
        attention.rope_math.softmax_scale = real
    return out


def test_verify_exits_1_on_a_wrong_export(wrong_demo_export):
    result = CliRunner().invoke(main, ["verify", str(wrong_demo_export), "--steps", "2"])
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines()[-1].startswith("FAIL")


def test_verify_reports_every_step_of_a_right_export_and_passes(exported):
    """Defaults: three prompts of 13, 7 and 3 tokens, 8 decode steps, tolerance 1e-4 x the logit scale."""
    report = verify_export(exported(VARIANT))
    assert report.passed and len(report.decode_max_abs) == 8 and report.token_agreement == 1.0
    assert report.lines[0].startswith("prefill  batch 3, lengths [13, 7, 3]") and report.rtol == 1e-4
    assert [line.split(":")[0] for line in report.lines[1:9]] == [f"decode   step {s:>3}" for s in range(1, 9)]
    assert report.lines[9].startswith("verify   8 tokens in one pass: max |Δlogit|")  # speculative decoding's pass
    # the prefill graph's absorbed form: a chunk after the prompts
    assert report.lines[10].startswith("prefill  8 tokens after the prompts, absorbed: max |Δlogit|")
    assert report.lines[11] == ("tokens   runtime greedy vs torch greedy: 24/24 agree, 0 more within the tolerance "
                                "of the source's own choice (near ties)")
    assert (
        report.lines[12]
        == f"PASS: tolerance {report.tolerance:.3e} (rtol 0.0001 x logit scale {report.logit_scale:.2f})"
    )
    assert 0 < max(report.decode_max_abs) <= report.tolerance == 1e-4 * max(1.0, report.logit_scale)
    assert len(report.checks) == 2 and max(report.checks) <= report.tolerance


def test_an_explicit_rtol_replaces_the_dtype_default(exported):
    """The same right export fails at a tolerance below its own float32 error (~1e-6 of the logit scale)."""
    report = verify_export(exported(VARIANT), steps=2, rtol=1e-12)
    assert report.rtol == 1e-12 and not report.passed and report.lines[-1].startswith("FAIL")


def test_near_ties_count_only_within_the_tolerance():
    """The source's logits before three generated tokens: its own choice, a token 1/16 below it, one 1/4 below."""
    before = np.array([[[1.0, 3.0, 2.0], [2.0, 1.9375, 0.0], [0.0, 0.75, 1.0]]])  # [b=1, steps=3, vocab=3]
    tokens = np.array([[1, 1, 1]])
    assert greedy_agreement(before, tokens, tolerance=0.1) == (1, 1)
    assert greedy_agreement(before, tokens, tolerance=0.25) == (1, 2)  # a margin equal to the tolerance is a tie
    assert greedy_agreement(before, tokens, tolerance=0.01) == (1, 0)
    assert greedy_agreement(before[:, :1], tokens[:, :1], tolerance=10.0) == (1, 0)  # the choice itself is no tie


def test_verify_counts_near_ties_as_agreement(exported, monkeypatch):
    """verify_export's token agreement is exact matches plus near ties (greedy_agreement, tested above): with two of
    the generated tokens reported as near ties, the export still agrees on every token and passes."""
    from mla_deploy import verify

    monkeypatch.setattr(verify, "greedy_agreement", lambda before, tokens, tolerance: (tokens.size - 2, 2))
    report = verify_export(exported(VARIANT), steps=2)
    assert report.token_agreement == 1.0 and report.passed
    assert any(line.endswith("4/6 agree, 2 more within the tolerance of the source's own choice (near ties)")
               for line in report.lines)


def test_verify_of_a_short_export_clips_the_prompts_and_states_its_tolerance(tmp_path):
    """max_seq_len 16, 4 steps: prompts clipped to 16 - 4 - 1 = 11 tokens. Random weights of std 0.02 give logits
    far below 1, so the tolerance is rtol x 1 (the floor), and the report says so."""
    from mla_deploy.presets import preset_config, write_random_checkpoint

    ckpt = write_random_checkpoint(preset_config("tiny-v3"), tmp_path / "ckpt", seed=0)
    export(ckpt, tmp_path / "out", ExportOptions(max_seq_len=16))
    report = verify_export(tmp_path / "out", steps=4)
    again = verify_export(tmp_path / "out", steps=4)
    assert report.lines == again.lines  # seeded prompts: the same report every time
    assert report.lines[0].startswith("prefill  batch 3, lengths [11, 7, 3]")
    assert report.logit_scale < 1 and report.tolerance == 1e-4
    assert report.lines[-1] == "PASS: tolerance 1.000e-04 (rtol 0.0001 x logit scale 1.00)"
    with pytest.raises(ExportError, match="--steps 15: too many for the export's maximum length 16"):
        verify_export(tmp_path / "out", steps=15)
    short = tmp_path / "short"  # the default steps fit an export shorter than 8 + 2; steps asked for must, or say so
    export(ckpt, short, ExportOptions(max_seq_len=6))
    assert verify_export(short, steps=None).passed
    tiny = tmp_path / "tiny"  # written without verification: verify then says why it cannot, not a --steps nobody gave
    export(ckpt, tiny, ExportOptions(max_seq_len=2))
    with pytest.raises(ExportError, match="maximum length 2 is too short to verify: a prompt token and a decode step"):
        verify_export(tiny)
    result = CliRunner().invoke(main, ["export", str(ckpt), "-o", str(tmp_path / "fits"), "--max-seq-len", "6"])
    assert result.exit_code == 0 and (tmp_path / "fits" / "manifest.json").exists(), result.output
    result = CliRunner().invoke(main, ["export", str(ckpt), "-o", str(tmp_path / "never"), "--max-seq-len", "2"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --max-seq-len 2: verification needs a prompt "
                                                              "token and a decode step"), result.output
    result = CliRunner().invoke(main, ["export", str(ckpt), "-o", str(tmp_path / "never"), "--max-seq-len", "6",
                                       "--steps", "8"])
    assert result.exit_code == 2 and not (tmp_path / "never").exists(), result.output
    assert result.stderr.startswith("error: --steps 8: verification decodes after a prompt within --max-seq-len 6, "
                                    "so at most 4 steps; lower --steps, or pass --no-verify"), result.stderr


def test_verify_refuses_another_checkpoint_and_a_short_generation(exported, checkpoint_dir, monkeypatch):
    with pytest.raises(ExportError, match="checkpoint differs from the one .* was exported from"):
        verify_export(exported(VARIANT), checkpoint_dir("v2_group_limited")[0])
    generate = Generator.generate

    def short(self, rows, steps):
        result = generate(self, rows, steps)
        result.token_ids[1] = result.token_ids[1][:-1]
        return result

    monkeypatch.setattr(Generator, "generate", short)
    with pytest.raises(ExportError, match=r"the runtime generated \[8, 7, 8\] tokens per row, expected 8"):
        verify_export(exported(VARIANT))


def test_eval_refuses_another_checkpoint_before_scoring(wrong_demo_export, tmp_path, monkeypatch):
    from mla_deploy import evaluate
    from mla_deploy.presets import preset_config, write_random_checkpoint

    other = write_random_checkpoint(preset_config("tiny-v3"), tmp_path / "other", seed=0)
    monkeypatch.setattr(evaluate, "export_scores", lambda *a, **k: pytest.fail("scored before checking the source"))
    with pytest.raises(ExportError, match="checkpoint differs from the one .* was exported from"):
        evaluate.evaluate(wrong_demo_export, DEMO_CHECKPOINT / "heldout.txt", checkpoint_dir=other)


def test_eval_exits_1_on_a_wrong_export(wrong_demo_export, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text((DEMO_CHECKPOINT / "heldout.txt").read_text()[:3000])
    result = CliRunner().invoke(main, ["eval", str(wrong_demo_export), "--text", str(text), "--window", "64"])
    assert result.exit_code == 1, result.output
    assert "disagree by more than 1e-4" in result.stderr


# ---- streamed text ----
def test_text_stream_never_splits_a_character():
    tokenizer = Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")
    text = "def naïve(x):  # «λ» → 日本語 ✓ 🙂\n    return x"
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer)
    pieces = [stream.push(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p == "") >= 1  # some byte tokens had to wait for the rest of their character


def test_text_stream_pieces_add_up_to_the_whole_decode_for_arbitrary_ids():
    """Windowed decoding against decoding everything: random ids (broken UTF-8, special tokens) included."""
    tokenizer = Tokenizer(DEMO_CHECKPOINT / "tokenizer.json")
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, 4096, rng.integers(1, 60)).tolist()
        stream = TextStream(tokenizer)
        pieces = "".join(stream.push(t) for t in ids)
        whole = tokenizer.decode(ids)
        assert whole.startswith(pieces) and (pieces == whole or whole.endswith("\ufffd")), ids
        assert pieces + stream.flush() == whole and stream.flush() == "", ids  # the end: what was held back


def test_complete_streams_the_prompt_then_exactly_the_completion(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-text") / "export"
    export(DEMO_CHECKPOINT, out)
    pieces = []
    result = complete(ExportedModel(out), prompt="class Stack:\n", max_new_tokens=24, sampling=SamplingParams(),
                      on_text=pieces.append)
    assert pieces[0] == "class Stack:\n"
    assert "".join(pieces[1:]) == result["text"] and len(result["token_ids"]) == 24
    cut = []  # a budget ending part-way through a character: the streamed text ends as the returned one, U+FFFD
    emoji = Tokenizer(DEMO_CHECKPOINT / "tokenizer.json").encode("🙂", add_special_tokens=False)
    assert len(emoji) > 1
    result = complete(ExportedModel(out), prompt_ids=[5, 6], max_new_tokens=1, on_text=cut.append,
                      sampling=SamplingParams(logit_bias=((emoji[0], 100.0),)))
    assert result["token_ids"] == emoji[:1] and result["text"] == "\ufffd" and "".join(cut) == result["text"]
