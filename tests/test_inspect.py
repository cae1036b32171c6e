"""`mla-deploy inspect`: its counts against the files and graphs they describe."""

import json

import onnx
import pytest
from click.testing import CliRunner

from mla_deploy.checkpoint import Checkpoint
from mla_deploy.cli import main
from mla_deploy.footprint import decode_read_bytes, parameter_counts
from mla_deploy.presets import DEMO_CHECKPOINT, preset_config
from mla_deploy.config import MLAConfig

VARIANT = "v3_lora_group_yarn"


def test_export_report_matches_its_graphs_and_weights(exported, checkpoint_dir):
    out = exported(VARIANT)
    result = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)
    ckpt = Checkpoint(checkpoint_dir(VARIANT)[0])
    cfg = ckpt.config
    assert r["parameters"]["total"] == sum(ckpt.tensor(n).size for n in ckpt.names())
    assert r["cache"] == "MLA float32"
    assert (
        r["cache_bytes_per_token"]["MLA float32"]
        == cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    )
    assert r["cache_bytes"]["MLA float32"]["4096"]["8"] == r["cache_bytes_per_token"]["MLA float32"] * 4096 * 8
    for kind in ("prefill", "decode"):
        graph = onnx.load(str(out / f"{kind}.onnx"), load_external_data=False).graph
        nodes = []

        def walk(g):
            for node in g.node:
                nodes.append(node.op_type)
                for attr in node.attribute:
                    if attr.type == onnx.AttributeProto.GRAPH:
                        walk(attr.g)

        walk(graph)
        counts = r["graphs"][kind]["op_counts"]
        assert sum(counts.values()) == len(nodes) and counts["MatMul"] == nodes.count("MatMul")
        assert [s["name"] for s in r["graphs"][kind]["inputs"]] == [i.name for i in graph.input]


def test_the_report_says_how_attention_and_experts_run(exported):
    """The export fixtures run their experts in If branches and, with 4 heads, the attention core in the kernel: the
    plan read back from the manifest is the one the export resolved, field for field."""
    from mla_deploy.export.plan import ExportOptions, ExportPlan

    out = exported(VARIANT)
    r = json.loads(CliRunner().invoke(main, ["inspect", str(out), "--json"]).stdout)
    assert (r["decode_attention"], r["experts"]) == ("kernel", "branches")
    cfg = Checkpoint(json.loads((out / "manifest.json").read_text())["source"]["path"]).config
    assert r["plan"] == ExportPlan.resolve(cfg, ExportOptions(absorb="fused", experts="branches")).to_dict()
    text = CliRunner().invoke(main, ["inspect", str(out)]).stdout
    line = next(line for line in text.splitlines() if line.startswith("plan"))
    assert line == ("plan       absorb fused; float32 weights computed in float32; float32 caches; decode attention in "
                    "mla_deploy.LatentAttention; prefill attention naive or absorbed, each call the cheaper; routed "
                    "experts in one If per expert; max_seq_len 256")


def test_deepseek_v2_lite_counts_are_its_published_ones():
    """15.7 B parameters, 2.4 B activated (DeepSeek-V2-Lite's model card), from the full-size preset's config."""
    cfg = MLAConfig.from_hf_dict(preset_config("v2lite"))
    p = parameter_counts(cfg)
    assert p["total"] / 1e9 == pytest.approx(15.7, abs=0.05) and p["active_per_token"] / 1e9 == pytest.approx(
        2.4, abs=0.06
    )
    # per token and layer: 512 latent + 64 rope floats, against 16 heads x (192 + 128) for MHA
    from mla_deploy.footprint import cache_bytes_per_token

    cache = cache_bytes_per_token(cfg)
    assert cache["MHA (16 KV heads), float32"] / cache["MLA float32"] == pytest.approx(16 * 320 / 576)
    assert cache["MQA (1 KV head), float32"] == 27 * 320 * 4
    # an int8 latent: 512 codes and a float32 scale a layer, the rope's 64 values in its float type
    assert cache["MLA int8 + float32 rope"] == 27 * (512 + 4 + 64 * 4)
    assert cache["MLA int8 + 16-bit rope"] == 27 * (512 + 4 + 64 * 2) == cache["MLA float16 / bfloat16"] * 644 // 1152
    assert cache_bytes_per_token(cfg, "bfloat16")["MHA (16 KV heads), 16-bit"] == 27 * 16 * 320 * 2


def test_checkpoint_report_in_text(tmp_path):
    result = CliRunner().invoke(main, ["inspect", str(DEMO_CHECKPOINT)])
    assert result.exit_code == 0 and result.stderr == ""
    assert "checkpoint" in result.stdout and "weights read per decode token" in result.stdout
    cfg = Checkpoint(DEMO_CHECKPOINT).config
    total = sum(decode_read_bytes(cfg, None).values())
    assert total > 0 and "*MLA float32" in result.stdout
    counts = parameter_counts(cfg)  # the demo's 5.38 M parameters read as millions, not as 0.005 B
    line = next(line for line in result.stdout.splitlines() if line.startswith("parameters"))
    assert line.startswith(f"parameters {counts['total'] / 1e6:.2f} M total (the embedding ") and " B" not in line, line
    assert f"{counts['active_per_token'] / 1e6:.2f} M multiplied per token" in line, line
    model = next(line for line in result.stdout.splitlines() if line.startswith("model"))
    assert f": {cfg.num_hidden_layers} layers, " in model, model


def test_neither_export_nor_checkpoint_is_named(tmp_path):
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 1 and "neither an export" in result.stderr and result.stdout == ""
    (tmp_path / "notes.txt").write_text("mine")
    for path, said in ((tmp_path / "gone", "does not exist; expected an export or a checkpoint directory"),
                       (tmp_path / "notes.txt", "is a file; expected an export or a checkpoint directory"),
                       (DEMO_CHECKPOINT / "config.json",
                        f"is a file; expected an export or a checkpoint directory: {DEMO_CHECKPOINT}?")):
        result = CliRunner().invoke(main, ["inspect", str(path)])
        assert result.exit_code == 1 and result.stderr == f"error: {path}: {said}\n", result.stderr


@pytest.mark.parametrize("damage", ["truncated", "graph"])
def test_a_damaged_export_is_reported_and_exits_1(exported, tmp_path, damage):
    import shutil

    out = tmp_path / "damaged"
    shutil.copytree(exported(VARIANT), out)
    if damage == "truncated":
        weights = out / "weights.bin"
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size - 100)
    else:
        with open(out / "decode.onnx", "ab") as f:
            f.write(b"\0")
    for args in ([], ["--json"]):
        result = CliRunner().invoke(main, ["inspect", str(out), *args])
        assert result.exit_code == 1, result.output
        problem = "truncated or replaced" if damage == "truncated" else "sha256 differs"
        assert problem in (json.loads(result.stdout)["damage"] if args else result.stdout)
    assert CliRunner().invoke(main, ["inspect", str(exported(VARIANT))]).exit_code == 0
