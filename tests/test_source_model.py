"""The torch source model against transformers: logits, caches, both attention forms, chunking, padding."""

import copy

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from mla_deploy.modeling import AttentionForm, load_model, new_caches
from mla_deploy.rope import deinterleave_perm

TOL = 1e-4  # float32 max abs difference of logits
FORMS = [AttentionForm.NAIVE, AttentionForm.ABSORBED]


def run_ours(model, ids, form, position_ids=None, kv_mask=None, capacity=None):
    b, t = ids.shape
    capacity = capacity or t
    caches = new_caches(model.cfg, b, capacity)
    pos = torch.arange(t)[None].expand(b, -1) if position_ids is None else position_ids
    mask = torch.ones(b, capacity) if kv_mask is None else kv_mask
    logits = model(ids, pos, caches, torch.zeros(b, dtype=torch.long), mask, form=form)
    return logits, caches


@pytest.mark.parametrize("form", FORMS)
def test_prefill_past_original_context_matches_transformers(checkpoint_dir, variant, form):
    directory, hf = checkpoint_dir(variant)
    model = load_model(directory)
    ids = torch.randint(3, model.cfg.vocab_size, (2, 80), generator=torch.Generator().manual_seed(1))
    assert ids.shape[1] > 32  # past original_max_position_embeddings of the YaRN variants
    with torch.no_grad():
        ref = hf(ids).logits
    ours, _ = run_ours(model, ids, form)
    assert ref.abs().max() > 0.5  # the comparison is not between near-zero numbers
    assert (ours - ref).abs().max().item() < TOL


@pytest.mark.parametrize("form", FORMS)
def test_left_padded_batch_matches_transformers(checkpoint_dir, variant, form):
    directory, hf = checkpoint_dir(variant)
    model = load_model(directory)
    lengths = [20, 13, 7]
    t = max(lengths)
    gen = torch.Generator().manual_seed(2)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, t - n :] = torch.randint(3, model.cfg.vocab_size, (n,), generator=gen)
        mask[r, t - n :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, position_ids=pos).logits
    ours, _ = run_ours(model, ids, form, position_ids=pos, kv_mask=mask)
    valid = mask.bool()
    assert (ours[valid] - ref[valid]).abs().max().item() < TOL


def test_right_padded_rows_equal_unpadded_rows(checkpoint_dir, variant):
    """Right padding: each row's cache is contiguous from slot 0; padded tail positions are ignored."""
    directory, hf = checkpoint_dir(variant)
    model = load_model(directory)
    lengths = [11, 4]
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, model.cfg.vocab_size, (n,), generator=gen) for n in lengths]
    ids = torch.zeros(2, max(lengths), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row
    ours, _ = run_ours(model, ids, AttentionForm.ABSORBED)
    for r, row in enumerate(rows):
        with torch.no_grad():
            ref = hf(row[None]).logits[0]
        assert (ours[r, : len(row)] - ref).abs().max().item() < TOL


@pytest.mark.parametrize("form", FORMS)
def test_16_cached_decode_steps_match_transformers(checkpoint_dir, variant, form):
    directory, hf = checkpoint_dir(variant)
    model = load_model(directory)
    prompt = torch.randint(3, model.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(4))
    steps = 16
    past = DynamicCache(config=hf.config)
    caches = new_caches(model.cfg, 1, prompt.shape[1] + steps)
    kv_mask = torch.ones(1, prompt.shape[1] + steps)
    with torch.no_grad():
        ref = hf(prompt, past_key_values=past, use_cache=True).logits[:, -1]
    ours = model(prompt, torch.arange(24)[None], caches, torch.zeros(1, dtype=torch.long), kv_mask, form=form)[:, -1]
    for step in range(steps):
        assert (ours - ref).abs().max().item() < TOL, f"step {step}"
        token = ref.argmax(-1, keepdim=True)  # [1, 1]
        slot = 24 + step
        with torch.no_grad():
            ref = hf(token, past_key_values=past, use_cache=True, position_ids=torch.tensor([[slot]])).logits[:, -1]
        ours = model(token, torch.tensor([[slot]]), caches, torch.tensor([slot]), kv_mask, form=form)[:, -1]
    assert (ours - ref).abs().max().item() < TOL


def test_naive_and_absorbed_agree(checkpoint_dir, variant):
    directory, _ = checkpoint_dir(variant)
    model = load_model(directory)
    ids = torch.randint(3, model.cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(5))
    naive, naive_caches = run_ours(model, ids, AttentionForm.NAIVE)
    absorbed, absorbed_caches = run_ours(model, ids, AttentionForm.ABSORBED)
    assert (naive - absorbed).abs().max().item() < TOL
    for a, b in zip(naive_caches, absorbed_caches):  # layer 0 equal; later layers see slightly different inputs
        assert (a.latent - b.latent).abs().max().item() < 1e-5 and (a.rope - b.rope).abs().max().item() < 1e-5


@pytest.mark.parametrize("chunks", [[39, 1], [17, 23], [1, 9, 30], [13, 13, 13, 1]])
def test_chunked_prefill_equals_one_shot(checkpoint_dir, variant, chunks):
    directory, _ = checkpoint_dir(variant)
    model = load_model(directory)
    ids = torch.randint(3, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(6))
    whole, whole_caches = run_ours(model, ids, AttentionForm.NAIVE)
    caches = new_caches(model.cfg, 2, 40)
    kv_mask = torch.ones(2, 40)
    pieces, start = [], 0
    for n in chunks:
        pos = torch.arange(start, start + n)[None].expand(2, -1)
        write = torch.full((2,), start, dtype=torch.long)
        pieces.append(model(ids[:, start : start + n], pos, caches, write, kv_mask, form=AttentionForm.NAIVE))
        start += n
    assert (torch.cat(pieces, 1) - whole).abs().max().item() < TOL
    for a, b in zip(caches, whole_caches):
        assert (a.latent - b.latent).abs().max().item() < 1e-5 and (a.rope - b.rope).abs().max().item() < 1e-5


def test_cache_equals_transformers_latent_cache(checkpoint_dir, variant):
    """transformers caches the same two tensors; its V2 keeps k_pe interleaved, so permute before comparing."""
    directory, hf = checkpoint_dir(variant)
    model = load_model(directory)
    ids = torch.randint(3, model.cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(7))
    past = DynamicCache(config=hf.config)
    with torch.no_grad():
        hf(ids, past_key_values=past, use_cache=True)
    _, caches = run_ours(model, ids, AttentionForm.ABSORBED)
    perm = torch.from_numpy(deinterleave_perm(model.cfg)) if hf.config.model_type == "deepseek_v2" else slice(None)
    for layer, cache in zip(past.layers, caches):
        ref_latent = layer.keys[:, 0]  # [b, 1, T, d_c] -> [b, T, d_c]
        ref_rope = layer.values[:, 0][..., perm]  # [b, 1, T, d_r] -> [b, T, d_r], rotate-half layout
        assert (cache.latent - ref_latent).abs().max().item() < 1e-5
        assert (cache.rope - ref_rope).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_load_as_float32(checkpoint_dir, tmp_path, dtype):
    _, hf = checkpoint_dir("v3_lora_group_yarn")
    half = copy.deepcopy(hf).to(dtype)  # never cast the shared reference model: float32 -> half -> float32 loses bits
    half.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    expected = half.model.layers[1].self_attn.kv_b_proj.weight.float()
    assert model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
    assert torch.equal(model.model.layers[1].self_attn.kv_b_proj.weight, expected)


def test_sharded_checkpoint_matches_single_file(checkpoint_dir, tmp_path):
    directory, hf = checkpoint_dir("v2_nolora_greedy_yarn")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    a, b = load_model(directory), load_model(tmp_path)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_random_weights_are_not_identical_across_layers(checkpoint_dir):
    """Guards the fixtures: a loader that mixed up layers would still pass if all layers were equal."""
    directory, _ = checkpoint_dir("v3_lora_group_yarn")
    model = load_model(directory)
    w0 = model.model.layers[0].self_attn.kv_b_proj.weight
    w1 = model.model.layers[1].self_attn.kv_b_proj.weight
    assert not np.allclose(w0.numpy(), w1.numpy())


def test_layer_by_layer_source_equals_the_whole_model(checkpoint_dir, variant):
    """modeling.layerwise (verify's source: one layer in memory) computes what MLAForCausalLM computes."""
    from mla_deploy.checkpoint import Checkpoint
    from mla_deploy.modeling.layerwise import layerwise_logits

    directory, _ = checkpoint_dir(variant)
    model = load_model(directory)
    gen = torch.Generator().manual_seed(2)
    lens = torch.tensor([9, 4])
    ids = torch.randint(3, model.cfg.vocab_size, (2, 9), generator=gen)
    ids[1, 4:] = 0  # right padding
    tokens = torch.randint(3, model.cfg.vocab_size, (2, 5), generator=gen)
    mask = torch.ones(2, 9 + 5)
    prefill, steps = layerwise_logits(Checkpoint(directory), ids, mask, lens, tokens)
    caches = new_caches(model.cfg, 2, 14)
    ref = model(
        ids,
        torch.arange(9)[None].expand(2, -1),
        caches,
        torch.zeros(2, dtype=torch.long),
        mask,
        form=AttentionForm.NAIVE,
    )
    assert ref.abs().max() > 0.5 and (prefill - ref).abs().max().item() < 1e-5
    for s in range(5):
        slot = lens + s
        ref = model(tokens[:, s : s + 1], slot[:, None], caches, slot, mask, form=AttentionForm.ABSORBED)
        assert (steps[:, s] - ref[:, 0]).abs().max().item() < 1e-5, s


@pytest.mark.parametrize("variant", ["v3_lora_group_yarn", "v2_nolora_greedy_yarn"])
def test_latent_norms_keep_their_own_eps_whatever_rms_norm_eps_says(tmp_path, variant):
    """transformers (and DeepSeek's code) build q_a_layernorm and kv_a_layernorm with RMSNorm's default eps; only the
    layers' and the final norm read rms_norm_eps. A large one shows it in the logits, of the source and the export."""
    from mla_deploy.export import export
    from mla_deploy.runtime import ExportedModel
    from mla_deploy.runtime.feeds import prefill_feed
    from mla_deploy import io_spec
    from tiny import build_hf_model, save_hf_model

    hf = build_hf_model(variant, rms_norm_eps=1e-2)
    save_hf_model(hf, tmp_path / "ckpt")
    model = load_model(tmp_path / "ckpt")
    ids = torch.randint(3, model.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    for form in FORMS:
        ours, _ = run_ours(model, ids, form)
        assert (ours - ref).abs().max().item() < TOL, form
    export(tmp_path / "ckpt", tmp_path / "out")
    exported = ExportedModel(tmp_path / "out", graphs=(io_spec.PREFILL,))
    logits = exported.run(io_spec.PREFILL, prefill_feed(exported.config, ids.numpy()))[io_spec.LOGITS]
    assert np.abs(logits - ref.numpy()).max() < TOL
