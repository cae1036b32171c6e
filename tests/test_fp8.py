"""FP8 block-scaled checkpoints in (DeepSeek-V3 / R1 layout): decoding, block scales, and an export checked against
the torch source loaded from an independent dequantization done with torch ops."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mla_deploy import fp8, io_spec
from mla_deploy.checkpoint import Checkpoint
from mla_deploy.errors import CheckpointError
from mla_deploy.export import ExportOptions, export
from mla_deploy.modeling import load_model
from mla_deploy.modeling.attention import AttentionForm
from mla_deploy.modeling.cache import new_caches
from mla_deploy.runtime import ExportedModel
from mla_deploy.runtime.feeds import prefill_feed

VARIANT = "v3_lora_group_yarn"
BLOCK = [16, 16]  # the tiny model's weights span several blocks, with partial blocks at the edges (40 = 16 + 16 + 8)


def test_e4m3_decoding_matches_torch_for_all_256_codes():
    codes = torch.arange(256, dtype=torch.uint8)
    expected = codes.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    got = fp8.e4m3_to_float32(codes.numpy())
    assert np.array_equal(np.isnan(got), np.isnan(expected)) and np.isnan(got).sum() == 2  # 0x7F and 0xFF
    assert np.array_equal(got[~np.isnan(got)], expected[~np.isnan(expected)])
    assert np.nanmax(got) == 448.0 and got[1] == 2.0 ** -9  # the largest normal, the smallest subnormal


def test_block_dequantization_matches_torch_at_ragged_edges():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(50, 37, generator=g)
    codes, scale_inv = quantize_torch(w, (16, 16))
    assert scale_inv.shape == fp8.scale_shape((50, 37), (16, 16)) == (4, 3)
    expected = dequantize_torch(codes, scale_inv, (16, 16)).numpy()
    got = fp8.dequantize(codes.view(torch.uint8).numpy(), scale_inv.numpy(), (16, 16))
    assert np.array_equal(got, expected)
    rows = fp8.dequantize(codes.view(torch.uint8).numpy()[16:32], scale_inv.numpy(), (16, 16), first_row=16)
    assert np.array_equal(rows, expected[16:32])  # a block row read on its own
    assert np.abs(got - w.numpy()).max() < 0.07 * np.abs(w.numpy()).max()  # and it is close to the original


def quantize_torch(w: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's scheme: per block, scale = amax / 448; codes = w / scale in float8_e4m3fn."""
    br, bc = block
    rows, cols = -(-w.shape[0] // br), -(-w.shape[1] // bc)
    padded = torch.zeros(rows * br, cols * bc)
    padded[: w.shape[0], : w.shape[1]] = w
    blocks = padded.reshape(rows, br, cols, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0  # [rows, cols]
    codes = (blocks / scale[:, None, :, None]).reshape(rows * br, cols * bc)[: w.shape[0], : w.shape[1]]
    return codes.to(torch.float8_e4m3fn), scale.to(torch.float32)


def dequantize_torch(codes: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return codes.to(torch.float32) * full[: codes.shape[0], : codes.shape[1]]


def is_fp8_weight(name: str, array: np.ndarray) -> bool:
    """What DeepSeek-V3 stores in FP8: every linear projection (not the embedding, head, norms or routers)."""
    return (
        array.ndim == 2
        and "embed_tokens" not in name
        and "lm_head" not in name
        and not name.endswith("mlp.gate.weight")
    )


@pytest.fixture(scope="module")
def fp8_checkpoints(checkpoint_dir, tmp_path_factory):
    """(the FP8 checkpoint, the same weights dequantized with torch ops and stored float32)."""
    src, _ = checkpoint_dir(VARIANT)
    config = json.loads((src / "config.json").read_text())
    state = Checkpoint(src).state_dict()
    quantized, dequantized = {}, {}
    for name, array in state.items():
        w = torch.from_numpy(array)
        if is_fp8_weight(name, array):
            codes, scale_inv = quantize_torch(w, BLOCK)
            quantized[name], quantized[name + "_scale_inv"] = codes, scale_inv
            dequantized[name] = dequantize_torch(codes, scale_inv, BLOCK)
        else:
            quantized[name] = dequantized[name] = w.contiguous()
    root = tmp_path_factory.mktemp("fp8")
    fp8_dir, float_dir = root / "fp8", root / "dequantized"
    for directory, tensors, cfg in (
        (fp8_dir, quantized, {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                 "activation_scheme": "dynamic",
                                                                 "weight_block_size": BLOCK}}),
        (float_dir, dequantized, config),
    ):
        directory.mkdir()
        save_file(tensors, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(cfg))
    return fp8_dir, float_dir


def test_fp8_checkpoint_reads_as_its_independent_dequantization(fp8_checkpoints):
    fp8_dir, float_dir = fp8_checkpoints
    ours, reference = Checkpoint(fp8_dir), Checkpoint(float_dir)
    assert ours.fp8_block == tuple(BLOCK) and sorted(ours.names()) == sorted(reference.names())
    quantized = [n for n in ours.names() if n in ours._scales]
    assert len(quantized) > 20  # attention, dense MLP and every expert
    for name in ours.names():
        assert np.array_equal(ours.tensor(name), reference.tensor(name)), name


def test_fp8_export_matches_the_torch_source_of_the_dequantized_weights(fp8_checkpoints, tmp_path):
    fp8_dir, float_dir = fp8_checkpoints
    out = tmp_path / "export"
    export(fp8_dir, out, ExportOptions())  # verified against the torch source on the way (reading FP8 itself)
    model = ExportedModel(out)
    ids = np.random.default_rng(0).integers(3, model.config.vocab_size, (2, 24))
    logits = model.run(io_spec.PREFILL, prefill_feed(model.config, ids))[io_spec.LOGITS]  # [2, 24, vocab]
    source = load_model(float_dir)  # the torch source on the torch-dequantized weights
    b, t = ids.shape
    expected = source(torch.from_numpy(ids), torch.arange(t).expand(b, t), new_caches(source.cfg, b, t),
                      torch.zeros(b, dtype=torch.long), torch.ones(b, t, dtype=torch.long), AttentionForm.NAIVE).numpy()
    scale = max(1.0, float(np.abs(expected).max()))
    assert np.abs(logits - expected).max() <= 1e-4 * scale


def test_fp8_checkpoint_errors_name_the_problem(fp8_checkpoints, tmp_path):
    fp8_dir, _ = fp8_checkpoints
    tensors = {}
    from safetensors.torch import load_file

    tensors = load_file(str(fp8_dir / "model.safetensors"))
    config = json.loads((fp8_dir / "config.json").read_text())

    def write(name, tensors, config):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(config))
        return d

    scale = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    no_scale = write("no-scale", {k: v for k, v in tensors.items() if k != scale}, config)
    with pytest.raises(CheckpointError, match="kv_a_proj_with_mqa.weight is float8_e4m3fn but .*_scale_inv is missing"):
        Checkpoint(no_scale)
    wrong_grid = write("wrong-grid", {**tensors, scale: torch.ones(1, 1)}, config)
    with pytest.raises(CheckpointError, match=r"weight_scale_inv has shape \[1, 1\], expected \[3, 4\]"):
        Checkpoint(wrong_grid)
    bad_scale = tensors[scale].clone()
    bad_scale[1, 2] = float("inf")
    inf_scale = write("inf-scale", {**tensors, scale: bad_scale}, config)  # named, not its weight's values
    with pytest.raises(CheckpointError, match=r"kv_a_proj_with_mqa.weight_scale_inv holds 1 non-finite "
                                              r"value\(s\) \(NaN or infinity\), the first inf at \[1, 2\]$"):
        Checkpoint(inf_scale).tensor(scale.removesuffix("_scale_inv"))
    norm = "model.layers.0.input_layernorm.weight"  # a float8 vector with a scale: refused, not an IndexError
    vector = write("vector", {**tensors, norm: tensors[norm].to(torch.float8_e4m3fn),
                              norm.removesuffix(".weight") + ".weight_scale_inv": torch.ones(1)}, config)
    with pytest.raises(CheckpointError, match=rf"{norm} is float8_e4m3fn of shape \[\d+\]: block-scaled float8 "
                                              r"weights are matrices \[out, in\]$"):
        Checkpoint(vector)
    int_scale = write("int-scale", {**tensors, scale: tensors[scale].to(torch.int32)}, config)
    with pytest.raises(CheckpointError, match=r"weight_scale_inv is I32: block scales are floating point"):
        Checkpoint(int_scale)
    no_config = write("no-config", tensors, {k: v for k, v in config.items() if k != "quantization_config"})
    with pytest.raises(CheckpointError, match="no FP8 quantization_config"):
        Checkpoint(no_config)
    e5m2 = write("e5m2", tensors, {**config, "quantization_config": {**config["quantization_config"], "fmt": "e5m2"}})
    with pytest.raises(CheckpointError, match="fmt 'e5m2' is not supported"):
        Checkpoint(e5m2)
    gptq = write("gptq", tensors, {**config, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        Checkpoint(gptq)
