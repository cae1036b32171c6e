"""Config reading (both transformers forms) and checkpoint checks: each bad input gets its own message."""

import json
import shutil

import numpy as np
import pytest

from mla_deploy.checkpoint import Checkpoint
from mla_deploy.config import MLAConfig
from mla_deploy.errors import CheckpointError, ConfigError
from mla_deploy.modeling import load_model
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.safetensors_io import SafetensorsFile, write_safetensors


def copy_checkpoint(checkpoint_dir, tmp_path, variant="v3_lora_group_yarn"):
    src, _ = checkpoint_dir(variant)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def edit_config(directory, **changes):
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            raw.pop(k, None)
        else:
            raw[k] = v
    path.write_text(json.dumps(raw))


def rewrite_weights(directory, fn):
    """Apply fn to the {name: array} state of model.safetensors and write it back."""
    f = SafetensorsFile(directory / "model.safetensors")
    state = {n: np.array(f.raw(n)) for n in f.entries}
    del f
    fn(state)
    write_safetensors(directory / "model.safetensors", state)


def test_transformers_4x_rope_scaling_form_reads_like_5x(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    modern = MLAConfig.from_hf_json(d / "config.json")
    raw = json.loads((d / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    params.pop("rope_type", None)
    params["type"] = "yarn"
    raw["rope_scaling"] = params
    legacy = MLAConfig.from_hf_dict(raw)
    assert legacy == modern
    assert legacy.rope_type == "yarn" and legacy.rope_factor == 8.0 and legacy.original_max_position_embeddings == 32


def test_a_rope_scaling_beside_rope_parameters_replaces_it_as_transformers_reads_it(checkpoint_dir, tmp_path):
    """transformers 5 writes rope_parameters into every config it saves; a YaRN rope_scaling added beside it (as model
    cards say) is the one transformers applies, whole, and so here; a YaRN block without its pre-scaling length
    takes the model's max_position_embeddings, as transformers does."""
    from transformers import DeepseekV3Config

    d = copy_checkpoint(checkpoint_dir, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e4}
    raw["rope_scaling"] = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 0.707,
                           "mscale_all_dim": 0.707, "rope_theta": 2e4}
    for scaling in (raw["rope_scaling"], {k: v for k, v in raw["rope_scaling"].items()
                                          if k != "original_max_position_embeddings"}):
        raw["rope_scaling"] = scaling
        ours, theirs = MLAConfig.from_hf_dict(raw), DeepseekV3Config.from_dict(raw).rope_parameters
        assert (ours.rope_type, ours.rope_factor, ours.rope_theta, ours.original_max_position_embeddings,
                ours.mscale) == (theirs["rope_type"], theirs["factor"], theirs["rope_theta"],
                                 theirs["original_max_position_embeddings"], theirs["mscale"]), theirs
    assert ours.original_max_position_embeddings == raw["max_position_embeddings"]


def test_a_yarn_block_without_its_length_takes_the_configs_own_original_length(checkpoint_dir, tmp_path):
    """`original_max_position_embeddings` beside the rope block, not in it (Phi-3's form): transformers' model moves
    it into the block, so the YaRN correction range follows it (the model's max_position_embeddings taken instead
    put the logits of a tiny V3 0.9 apart)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mla_deploy.modeling import new_caches

    d = copy_checkpoint(checkpoint_dir, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=1e4, original_max_position_embeddings=16, max_position_embeddings=256,
               rope_scaling={"type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    (d / "config.json").write_text(json.dumps(raw))
    ours = load_model(d)
    assert ours.cfg.original_max_position_embeddings == 16
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(3, ours.cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits
    got = ours(ids, torch.arange(24)[None], new_caches(ours.cfg, 1, 24), torch.zeros(1, dtype=torch.long),
               torch.ones(1, 24))
    assert (got - ref).abs().max().item() < 1e-4


def test_missing_field_is_named(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    edit_config(d, hidden_size=...)
    with pytest.raises(ConfigError, match="missing field.*hidden_size"):
        Checkpoint(d)


def test_a_left_out_shape_field_is_named_beside_the_shapes_it_decides(checkpoint_dir, tmp_path):
    """kv_lora_rank left out is taken as transformers' default (512): the wrong shapes that follow name it."""
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    edit_config(d, kv_lora_rank=...)
    with pytest.raises(CheckpointError, match=r"wrong shape .* \| config.json leaves out kv_lora_rank \(taken as 512"):
        Checkpoint(d)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "rope type 'dynamic' is not supported",
        ),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "rope_theta": 1e4, "truncate": False}}, "yarn 'truncate': False is not supported"),
        ({"q_lora_rank": "big"}, "q_lora_rank must be null"),
        ({"topk_method": "greedy"}, "topk_method 'greedy' is not supported for deepseek_v3"),
        ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
        ({"n_group": 3}, "n_routed_experts=8 is not divisible by n_group=3"),
        ({"model_type": "llama"}, "model_type 'llama' is not an MLA model"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"model_type": "deepseek_v2", "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": True},
         "norm_topk_prob: true with softmax routing is read two ways"),
        # a field of the wrong type is named, not read by truthiness nor failed on inside (transformers refuses them)
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
        ({"rope_interleave": "false"}, "rope_interleave must be true or false, got 'false'"),
        ({"eos_token_id": "2"}, r"eos_token_id must be a token id or a list of them .*got \['2'\]"),
        ({"first_k_dense_replace": None}, "first_k_dense_replace must be an integer >= 0, got None"),
        ({"num_nextn_predict_layers": "x"}, "num_nextn_predict_layers must be an integer >= 0, got 'x'"),
        ({"n_group": "4"}, "n_group must be null or a positive integer, got '4'"),
        ({"num_experts_per_tok": 3.0}, "num_experts_per_tok must be null or a positive integer, got 3.0"),
        ({"moe_intermediate_size": None}, "moe_intermediate_size must be a positive integer, got None"),
        ({"routed_scaling_factor": "2.5"}, "routed_scaling_factor must be a number, got '2.5'"),
        ({"rms_norm_eps": None}, "rms_norm_eps must be a positive number, got None"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": None}}, "rope_theta must be a positive number"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "32",
                              "rope_theta": 1e4}}, "original_max_position_embeddings must be null or a positive int"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": "1", "rope_theta": 1e4}},
         "mscale must be a number, got '1'"),
    ],
)
def test_invalid_config_refused_with_specific_message(checkpoint_dir, tmp_path, changes, message):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    edit_config(d, **changes)
    with pytest.raises(ConfigError, match=message):
        Checkpoint(d)


def test_head_dims_that_do_not_add_up_are_wrong_shapes(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    edit_config(d, qk_nope_head_dim=12)
    with pytest.raises(CheckpointError, match=r"wrong shape.*q_b_proj.weight: \[96, 24\] \(expected \[80, 24\]\)"):
        Checkpoint(d)


def test_missing_tensor_named(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    rewrite_weights(d, lambda s: s.pop("model.layers.1.self_attn.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing \(1\): model.layers.1.self_attn.kv_b_proj.weight"):
        Checkpoint(d)


@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_a_non_finite_weight_is_refused_by_name(checkpoint_dir, tmp_path, value):
    """Every logit it reached would be NaN, and an export of it would sample arbitrary tokens."""
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    name = "model.layers.1.self_attn.kv_b_proj.weight"

    def damage(s):
        s[name] = np.array(s[name], np.float32)
        s[name][3, 5] = value

    rewrite_weights(d, damage)
    ckpt = Checkpoint(d)  # shapes are checked on open, values as each tensor is read
    ckpt.tensor("model.norm.weight")
    with pytest.raises(CheckpointError, match=rf"{name} holds 1 non-finite value\(s\) .* at \[3, 5\]"):
        ckpt.tensor(name)


@pytest.mark.parametrize("dtype, stored", [(np.int32, "I32"), (np.int8, "I8"), (np.bool_, "BOOL")])
def test_a_weight_stored_as_integers_is_refused_by_name(checkpoint_dir, tmp_path, dtype, stored):
    """Integer codes are no weights the model can read (quantized formats carry their own scales and names): an
    export would widen them to floats and write a model that says nothing."""
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    name = "model.layers.1.self_attn.kv_b_proj.weight"

    def damage(s):
        s[name] = np.zeros(s[name].shape, dtype)

    rewrite_weights(d, damage)
    with pytest.raises(CheckpointError, match=rf"not floating point \(F32, F16, BF16, F8_E4M3, F64\) \(1\): "
                                              rf"{name}: {stored}$"):
        Checkpoint(d)


def test_wrong_shape_and_unexpected_listed_together(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)

    def damage(s):
        s["model.norm.weight"] = np.ones(10, np.float32)
        s["model.layers.0.self_attn.extra.weight"] = np.ones(3, np.float32)

    rewrite_weights(d, damage)
    with pytest.raises(CheckpointError) as e:
        Checkpoint(d)
    assert "unexpected (1): model.layers.0.self_attn.extra.weight" in str(e.value)
    assert "model.norm.weight: [10] (expected [64])" in str(e.value)


def test_pickle_only_checkpoint_refused_without_loading(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    (d / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    # A pickle that would create a file if it were ever unpickled.
    import pickle

    class Exploit:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(CheckpointError, match="only pickle weights found \\(pytorch_model.bin\\).*refused"):
        Checkpoint(d)
    assert not marker.exists()


def test_truncated_safetensors_named(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated: tensor .* ends at byte"):
        Checkpoint(d)


def test_garbage_safetensors_named(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(CheckpointError, match="model.safetensors: truncated safetensors file"):
        Checkpoint(d)


def test_missing_shard_named(checkpoint_dir, tmp_path):
    _, hf = checkpoint_dir("v3_lora_group_yarn")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard file\\(s\\) missing: {shard.name}"):
        Checkpoint(tmp_path)


def test_incomplete_mtp_layer_is_refused_by_name(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    rewrite_weights(d, lambda s: s.update({f"model.layers.{n}.eh_proj.weight": np.ones((4, 4), np.float32)}))
    with pytest.raises(CheckpointError, match=rf"multi-token-prediction layer {n} is incomplete: missing \(41\): "
                                              rf"model.layers.{n}.input_layernorm.weight.* wrong shape .*eh_proj"):
        Checkpoint(d)


def test_layers_past_the_config_that_are_no_mtp_module_are_skipped_with_a_note(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    rewrite_weights(d, lambda s: s.update({f"model.layers.{n + 1}.eh_proj.weight": np.ones((4, 4), np.float32)}))
    ckpt = Checkpoint(d)
    assert any(f"skipped layer(s) {n + 1}: past config.json's num_hidden_layers={n}" in note for note in ckpt.notes)
    assert not ckpt.has_mtp and not any(name.startswith(f"model.layers.{n + 1}.") for name in ckpt.names())


def test_a_cut_config_over_a_checkpoint_with_an_mtp_module_says_why_there_is_no_draft(tmp_path):
    """The demo (4 layers and its MTP module at layer 4) read as 2 layers: layers 2-4 are skipped, and the one note
    says the MTP module is there but drafts for the whole model, not that the checkpoint lacks layer-2 weights."""
    d = tmp_path / "demo"
    shutil.copytree(DEMO_CHECKPOINT, d)
    edit_config(d, num_hidden_layers=2)
    ckpt = Checkpoint(d)
    assert not ckpt.has_mtp and ckpt.notes == [
        "skipped layer(s) 2-4: past config.json's num_hidden_layers=2 (layer 2 is no multi-token-prediction module: "
        "no enorm./hnorm./eh_proj.): the model is its first 2 layers, as transformers reads it; the MTP module at "
        "layer 4 drafts for the whole model: no MTP draft graph"]


def source_logits(ckpt, ids):
    """The torch source model's logits over `ids` [1, t], from position 0."""
    import torch

    from mla_deploy.modeling import AttentionForm, new_caches

    model, t = load_model(ckpt), ids.shape[1]
    return model(ids, torch.arange(t)[None], new_caches(model.cfg, 1, t), torch.zeros(1, dtype=torch.long),
                 torch.ones(1, t), form=AttentionForm.NAIVE)


def test_a_config_cut_to_fewer_layers_reads_the_first_ones_as_transformers_does(checkpoint_dir, tmp_path):
    """num_hidden_layers lowered (a quick test of a deep checkpoint): layer n is no MTP module, so the layers from n
    on are skipped, not refused as an incomplete MTP layer; the logits are transformers' over the same config."""
    import torch
    from transformers import AutoModelForCausalLM

    d = copy_checkpoint(checkpoint_dir, tmp_path)
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"] - 1
    edit_config(d, num_hidden_layers=n)
    ckpt = Checkpoint(d)
    assert any(f"skipped layer(s) {n}: past config.json's num_hidden_layers={n}" in note for note in ckpt.notes)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(3, ckpt.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = hf(ids).logits, source_logits(ckpt, ids)
    assert (got - expected).abs().max() < 1e-4 * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize("same", [True, False])
def test_a_tied_config_over_a_stored_head_reads_it_as_transformers_does(checkpoint_dir, tmp_path, same):
    """tie_word_embeddings true and lm_head.weight stored too: a copy of the embedding is dropped, a head of other
    values is the output layer, untied with a note (transformers does not tie them either)."""
    import torch
    from transformers import AutoModelForCausalLM

    d = copy_checkpoint(checkpoint_dir, tmp_path)
    edit_config(d, tie_word_embeddings=True)

    def add_head(state):
        embed = state["model.embed_tokens.weight"]
        state["lm_head.weight"] = embed.copy() if same else np.random.default_rng(0).normal(size=embed.shape).astype(
            embed.dtype)
    rewrite_weights(d, add_head)
    ckpt = Checkpoint(d)
    assert ckpt.config.tie_word_embeddings is same
    assert any("lm_head.weight holds other values" in note for note in ckpt.notes) is not same
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(3, ckpt.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, got = hf(ids).logits, source_logits(ckpt, ids)
    assert (got - expected).abs().max() < 1e-4 * max(1.0, expected.abs().max().item())


def test_an_index_whose_weight_map_is_not_an_object_is_named(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(CheckpointError, match="corrupt index \\(weight_map must map each tensor name to a file name"):
        Checkpoint(d)


def test_packed_experts_read_as_per_expert(checkpoint_dir, tmp_path):
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    reference = load_model(d)

    def pack(s):
        prefix = "model.layers.1.mlp.experts"
        n = 8
        gate_up = [
            np.concatenate([s.pop(f"{prefix}.{e}.gate_proj.weight"), s.pop(f"{prefix}.{e}.up_proj.weight")])
            for e in range(n)
        ]
        s[f"{prefix}.gate_up_proj"] = np.stack(gate_up)
        s[f"{prefix}.down_proj"] = np.stack([s.pop(f"{prefix}.{e}.down_proj.weight") for e in range(n)])

    rewrite_weights(d, pack)
    packed = load_model(d)
    for (name, a), (_, b) in zip(reference.state_dict().items(), packed.state_dict().items()):
        assert np.array_equal(a.numpy(), b.numpy()), name


# ---- streaming reads and writes ----
def test_bfloat16_rounding_matches_torch():
    import torch

    from mla_deploy.safetensors_io import bf16_to_float32, float32_to_bf16

    rng = np.random.default_rng(0)
    values = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 3,
                             # exact ties: the dropped half is 0x8000, rounded to even both ways
                             (np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32)).view(np.float32)])
    ours = float32_to_bf16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (ours == theirs).all()
    assert (bf16_to_float32(ours) == torch.from_numpy(values).to(torch.bfloat16).float().numpy()).all()


def test_sharded_bfloat16_random_checkpoint_reads_back(tmp_path, monkeypatch):
    """Shards with an index, as published; bfloat16 values equal the float32 draw rounded, block by block."""
    from mla_deploy import presets, safetensors_io

    raw = {**presets.preset_config("tiny-v3"), "torch_dtype": "bfloat16"}
    monkeypatch.setattr(presets, "SHARD_BYTES", presets.checkpoint_bytes(MLAConfig.from_hf_dict(raw), 2) // 3)
    monkeypatch.setattr(safetensors_io, "_BLOCK_ELEMENTS", 1000)  # many blocks per tensor
    monkeypatch.setattr(presets, "_BLOCK_ELEMENTS", 1000)
    half = Checkpoint(presets.write_random_checkpoint(raw, tmp_path / "bf16", seed=1))
    full = Checkpoint(presets.write_random_checkpoint({**raw, "torch_dtype": "float32"}, tmp_path / "f32", seed=1))
    index = json.loads((tmp_path / "bf16" / presets.INDEX_FILE).read_text())
    assert len(half.files) >= 3 and set(index["weight_map"]) == set(half.names())
    for name in full.names():
        rounded = safetensors_io.bf16_to_float32(safetensors_io.float32_to_bf16(full.tensor(name)))
        assert (half.tensor(name) == rounded).all(), name


def test_writer_refuses_out_of_plan_tensors(tmp_path):
    from mla_deploy.safetensors_io import SafetensorsWriter

    plan = {"a": ("F32", (2, 3)), "b": ("F32", (4,))}
    with pytest.raises(ValueError, match="wrote 'b', expected 'a' next"):
        with SafetensorsWriter(tmp_path / "x.safetensors", plan) as w:
            w.write("b", np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"'a' got 12 bytes"):
        with SafetensorsWriter(tmp_path / "x.safetensors", plan) as w:
            w.write_blocks("a", [np.zeros((1, 3), np.float32)])
    with pytest.raises(ValueError, match="1 planned tensor"):
        with SafetensorsWriter(tmp_path / "x.safetensors", plan) as w:
            w.write("a", np.zeros((2, 3), np.float32))


def test_a_tensor_stored_in_two_files_is_refused(checkpoint_dir, tmp_path):
    """Which copy would be the model's depends on the order the files are read in: refused, naming both files."""
    d = copy_checkpoint(checkpoint_dir, tmp_path)
    f = SafetensorsFile(d / "model.safetensors")
    name = "model.norm.weight"
    extra = {name: np.array(f.raw(name)) + 1}
    del f
    write_safetensors(d / "model-extra.safetensors", extra)
    (d / "model.safetensors").rename(d / "model-main.safetensors")
    main = {n: "model-main.safetensors" for n in SafetensorsFile(d / "model-main.safetensors").entries}
    index = {"weight_map": {**main, name: "model-extra.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{name}: stored in both model-extra.safetensors and "
                                              "model-main.safetensors"):
        Checkpoint(d)
