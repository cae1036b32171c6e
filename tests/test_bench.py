"""The benchmark code paths on a tiny preset: every engine runs and reports the right fields. No timing assertions."""

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from mla_deploy.errors import MLADeployError, install_command
from mla_deploy.bench import BenchConfig, run_bench
from mla_deploy.bench.report import save, table
from mla_deploy.bench.run import ALL_ENGINES, expected_active_experts, fit_contexts, needed_exports
from mla_deploy.footprint import decode_read_bytes, latent_cache_bytes_per_token, mha_cache_bytes_per_token
from mla_deploy.cli import main
from mla_deploy.config import MLAConfig
from mla_deploy.export.absorb import AbsorbMode, resolve_absorb
from mla_deploy.presets import preset_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    cfg = BenchConfig(preset="tiny-v3", workdir=work, contexts=(8, 40), batches=(1, 3), steps=1, prefill_tokens=16,
                      bandwidth_mb=64, speculative=("lookup",), draft_tokens=3)
    return run_bench(cfg)


def test_every_engine_reports_every_point(result):
    points = {(r["engine"], r["ctx"], r["batch"]) for r in result.rows}
    assert points == {(e, c, b) for e in ALL_ENGINES for c in (8, 40) for b in (1, 3)}
    for r in result.rows:
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["step_ms"], rel=1e-2)
        if r["engine"].startswith("onnx"):
            assert 0 < r["fraction_of_limit"] and r["limit_step_ms"] > 0 and r["bytes_per_step"] > 0
    assert {p["engine"] for p in result.prefill} == set(ALL_ENGINES) - {"onnx-mha-baseline"}
    assert set(result.bandwidth_gbs) == {"matmul_start", "numpy_threads", "matmul_end"}
    assert all(v > 0 for v in result.bandwidth_gbs.values())
    assert result.runtime_start["torch_imported"] is False and result.runtime_start["load_s"] > 0


def test_speculative_modes_report_speed_and_acceptance_against_off(result):
    """bench --speculative: off and lookup over the same prompts (a random model: the repeating prompt only, no
    tokenizer), each with its tokens/s, the ratio to off in the same run, and the drafts proposed and accepted."""
    rows = {(r["prompt"], r["mode"]): r for r in result.speculative}
    assert set(rows) == {("repeating", "off"), ("repeating", "lookup")}
    off, lookup = rows["repeating", "off"], rows["repeating", "lookup"]
    assert off["tokens_per_s"] > 0 and off["vs_off"] == 1.0 and "proposed" not in off
    assert lookup["draft_tokens"] == 3 and 0 <= lookup["accepted"] <= lookup["proposed"]
    assert lookup["vs_off"] == pytest.approx(lookup["tokens_per_s"] / off["tokens_per_s"])
    assert "speculative decoding" in table(result) and "lookup" in table(result)


def test_cache_bytes_ratio_is_the_formula(result):
    cfg = MLAConfig.from_hf_dict(preset_config("tiny-v3"))
    latent = {r["cache_bytes_per_token"] for r in result.rows if r["engine"] == "onnx-fused"}
    mha = {r["cache_bytes_per_token"] for r in result.rows if r["engine"] == "onnx-mha-baseline"}
    ratio = mha.pop() / latent.pop()
    h, dn, dr, dv, dc = 4, 16, 8, 16, 32
    assert ratio == h * (dn + dr + dv) / (dc + dr) == cfg.mha_cache_width / cfg.latent_cache_width


def test_report_table_json_and_chart(result, tmp_path):
    text = table(result)
    assert "onnx-fused" in text and "targets (measured in this run):" in text and "bandwidth (GB/s)" in text
    json_path, png = save(result, tmp_path)
    data = json.loads(json_path.read_text())
    assert data["machine"]["threads"] == 2 and len(data["rows"]) == len(result.rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reference_preset_traffic_matches_the_issue_figures():
    cfg = MLAConfig.from_hf_dict(preset_config("v2lite-2L"))
    # lm_head 0.84 GB + attention 0.11 + dense MLP 0.27 + 6 routed and 2 shared experts 0.28 = 1.50 GB
    groups = decode_read_bytes(cfg, AbsorbMode.FACTORED)
    assert sum(groups.values()) / 1e9 == pytest.approx(1.50, abs=0.01)
    assert groups["lm_head"] / 1e9 == pytest.approx(0.84, abs=0.005) and groups["dense_mlp"] / 1e9 == pytest.approx(
        0.27, abs=0.005
    )
    assert (groups["routed_experts"] + groups["shared_experts"]) / 1e9 == pytest.approx(0.28, abs=0.005)
    assert resolve_absorb(cfg, "auto") == AbsorbMode.FACTORED  # fused matrices are ~3x larger here
    assert mha_cache_bytes_per_token(cfg) / latent_cache_bytes_per_token(cfg) == pytest.approx(16 * 320 / 576)
    assert expected_active_experts(cfg, 1) == pytest.approx(6)


def test_bench_cli_quick_path(tmp_path):
    """Results go to --out, or by default beside the work directory's checkpoint and exports."""
    out = CliRunner().invoke(main, ["bench", "--quick", "--preset", "tiny-v3", "--workdir", str(tmp_path / "w"),
                                    "--out", str(tmp_path / "r"), "--contexts", "8", "--steps", "1"])
    assert out.exit_code == 0, out.output
    assert (tmp_path / "r" / "quick.json").exists() and "onnx-fused" in out.output
    again = CliRunner().invoke(main, ["bench", "--quick", "--preset", "tiny-v3", "--workdir", str(tmp_path / "w"),
                                      "--contexts", "8", "--steps", "1", "--engines", "onnx-fused"])
    assert again.exit_code == 0, again.output
    assert f"saved {tmp_path / 'w' / 'results' / 'quick.json'}" in again.output


def test_a_workdir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "file").write_text("mine")
    out = CliRunner().invoke(main, ["bench", "--quick", "--preset", "tiny-v3", "--workdir", str(tmp_path / "file")])
    assert out.exit_code == 1 and f"--workdir {tmp_path / 'file'}: is a file" in out.output, out.output
    assert (tmp_path / "file").read_text() == "mine"


def test_results_that_could_not_be_saved_are_refused_before_the_run(tmp_path, monkeypatch):
    """--out a file, under a file, or read-only, and a --workdir that cannot be created: one line each before any
    checkpoint or export is built (found after the run, its results would be lost). results.json is whole or
    absent: written beside, then renamed."""
    from mla_deploy.bench import run as bench_run

    monkeypatch.setattr(bench_run, "build_preset", lambda *a, **k: pytest.fail("built before the destination was "
                                                                             "checked"))
    (tmp_path / "file").write_text("mine")
    readonly = tmp_path / "ro"
    readonly.mkdir()
    readonly.chmod(0o555)
    try:
        cases = [(["--out", str(tmp_path / "file")], f"--out {tmp_path / 'file'}: is a file"),
                 (["--out", str(tmp_path / "file" / "r")], f"--out {tmp_path / 'file' / 'r'}: cannot be created"),
                 (["--workdir", str(tmp_path / "file" / "w"), "--out", str(tmp_path / "r")],
                  f"--workdir {tmp_path / 'file' / 'w'}: cannot be created")]
        if not os.access(readonly, os.W_OK):  # root writes anywhere
            cases.append((["--out", str(readonly)], f"--out {readonly}: is not writable"))
        for args, says in cases:
            out = CliRunner().invoke(main, ["bench", "--quick", "--preset", "tiny-v3", *args])
            assert out.exit_code == 1 and out.output.strip().splitlines()[-1].startswith(f"error: {says}"), out.output
        assert (tmp_path / "file").read_text() == "mine"
    finally:
        readonly.chmod(0o755)

    class Result:
        def to_json(self):
            raise OSError(28, "No space left on device")

    with pytest.raises(MLADeployError, match=f"--out {tmp_path / 'r'}: cannot save the results"):
        save(Result(), tmp_path / "r")
    assert list((tmp_path / "r").iterdir()) == []  # no partial file


def test_only_the_exports_the_chosen_engines_read_are_built(tmp_path):
    def needed(engines, speculative=()):
        return needed_exports(BenchConfig(preset="tiny-v3", workdir=tmp_path, engines=engines, speculative=speculative))

    assert needed(("onnx-factored",)) == ["factored"] and needed(("onnx-fused", "transformers")) == ["fused"]
    assert needed(("onnx-mha-baseline",)) == ["fused"] and needed(("torch-naive",)) == []
    assert needed(("onnx-fused",), ("lookup",)) == needed(ALL_ENGINES) == ["fused", "factored"]


def test_contexts_beyond_the_models_length_are_fitted_or_refused(tmp_path):
    """tiny-v3 holds 4096 positions: `bench --quick`'s default 4k point is measured at the longest that fits; a context
    the user names beyond it is an error naming the limit, before anything is built."""
    said = []
    cfg = fit_contexts(BenchConfig.quick(preset="tiny-v3", workdir=tmp_path), said.append)
    assert cfg.contexts == (128, 4096 - cfg.room) and cfg.max_len() == 4096, cfg.contexts
    assert said == [f"context 4096 measured at {4096 - cfg.room}, the longest that fits the model's 4096 positions "
                    f"(max_position_embeddings) less {cfg.room} for the timed steps"]
    out = CliRunner().invoke(main, ["bench", "--preset", "tiny-v3", "--workdir", str(tmp_path / "w"),
                                    "--contexts", "8,4090", "--steps", "1"])
    assert out.exit_code == 1 and "--contexts 4090: beyond the model's 4096 positions" in out.output, out.output
    assert "the longest that fits is 4087" in out.output and not (tmp_path / "w").exists()


def test_decompressed_kv_baseline_computes_the_same_model(checkpoint_dir, tmp_path):
    """The baseline is only a fair comparison if it is the same model: token by token, its logits equal the source's."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from mla_deploy import io_spec
    from mla_deploy.bench.mha_baseline import export_mha_baseline, past_key, past_value, present_key, present_value
    from mla_deploy.modeling import load_model, new_caches

    from mla_deploy.bench import mha_baseline

    src, _ = checkpoint_dir("v3_lora_group_yarn")
    with pytest.MonkeyPatch.context() as patch:  # interrupted while saving the graph: nothing a later run would reuse
        patch.setattr(mha_baseline.ir, "save", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
        with pytest.raises(KeyboardInterrupt):
            export_mha_baseline(src, tmp_path)
    assert list(tmp_path.iterdir()) == []
    path = export_mha_baseline(src, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode_mha.onnx", "weights_mha.bin"]  # no partial left
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    model = load_model(src)
    cfg = model.cfg
    ids = [5, 17, 33, 8, 61, 12]
    caches = new_caches(cfg, 1, len(ids))
    feed = {}
    for i in range(cfg.num_hidden_layers):
        feed[past_key(i)] = np.zeros((1, cfg.num_attention_heads, 0, cfg.qk_head_dim), np.float32)
        feed[past_value(i)] = np.zeros((1, cfg.num_attention_heads, 0, cfg.v_head_dim), np.float32)
    names = [o.name for o in session.get_outputs()]
    for pos, token in enumerate(ids):
        feed[io_spec.INPUT_IDS], feed[io_spec.POSITION_IDS] = np.array([[token]]), np.array([[pos]])
        out = dict(zip(names, session.run(names, feed)))
        ref = model(
            torch.tensor([[token]]), torch.tensor([[pos]]), caches, torch.tensor([pos]), torch.ones(1, len(ids))
        )
        assert np.abs(out[io_spec.LOGITS] - ref.numpy()).max() < 1e-4
        for i in range(cfg.num_hidden_layers):
            feed[past_key(i)], feed[past_value(i)] = out[present_key(i)], out[present_value(i)]


def test_warm_up_runs_until_two_calls_agree(monkeypatch):
    from mla_deploy.bench import engines

    durations = iter([5.0, 2.0, 1.5, 1.0, 0.95, 0.9, 0.9, 0.9, 0.9])  # seconds each call takes
    clock = {"now": 0.0, "pending": 0.0}

    def fn():
        clock["pending"] = next(durations)

    def perf_counter():
        clock["now"] += clock["pending"]
        clock["pending"] = 0.0
        return clock["now"]

    monkeypatch.setattr(engines.time, "perf_counter", perf_counter)
    assert engines._warm_up(fn) == 5  # 1.0 -> 0.95 is the first change under 10 %
    slow = iter([10 * 0.7**i for i in range(20)])  # 30 % faster each call, never steady: stops at the cap
    assert engines._warm_up(lambda: clock.update(pending=next(slow))) == engines.WARMUP_MAX


def test_compare_llamacpp_rounds_keep_each_engines_median(monkeypatch):
    """--rounds: decode at ctx 128 measured again with the engines alternating; the pair's figures become each
    engine's median over the rounds, which are kept beside them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_llamacpp", ROOT / "benchmarks" / "compare_llamacpp.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    order, theirs, ours = [], iter([30.0, 10.0]), iter([25.0, 40.0])
    monkeypatch.setattr(compare, "llama_decode", lambda *a: order.append("theirs") or next(theirs))
    monkeypatch.setattr(compare, "ours_decode", lambda *a: order.append("ours") or next(ours))
    monkeypatch.setattr(compare, "page_in", lambda path: order.append(f"page_in {path.name}"))
    pair = {"ours": {"decode_128": 50.0, "prefill_512": 1.0}, "theirs": {"decode_128": 20.0, "prefill_512": 2.0}}
    compare.decode_rounds(pair, 3, None, Path("q4_0.gguf"), Path("export"), 2)
    # each engine's file read right before its round: the other's has pushed it out of the page cache
    assert order == ["page_in q4_0.gguf", "theirs", "page_in weights.bin", "ours"] * 2
    assert pair["decode_128_rounds"] == [[50.0, 20.0], [25.0, 30.0], [40.0, 10.0]]
    assert pair["ours"] == {"decode_128": 40.0, "prefill_512": 1.0}
    assert pair["theirs"] == {"decode_128": 20.0, "prefill_512": 2.0}


def test_speculative_rows_say_when_mtp_is_left_out(exported):
    """An export without a draft graph has no mtp rows, and the benchmark says why instead of dropping them quietly."""
    from mla_deploy.bench.speculative import speculative_rows
    from mla_deploy.runtime import ExportedModel

    export_dir = exported("v3_lora_group_yarn")
    assert not ExportedModel(export_dir).has_draft
    said = []
    rows = speculative_rows(export_dir, ("off", "mtp"), 1, new_tokens=4, repeats=1, progress=said.append)
    assert {r["mode"] for r in rows} == {"off"}
    assert any("mtp left out: the export has no draft graph" in s for s in said), said


def test_an_engine_whose_module_is_missing_is_named_before_anything_is_built(tmp_path, monkeypatch):
    """The transformers engine without the transformers package: the extra to install, said before the checkpoint,
    the exports and the bandwidth probe, not after them."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "transformers" else find(name, *args))
    out = CliRunner().invoke(main, ["bench", "--preset", "tiny-v3", "--workdir", str(tmp_path / "w"),
                                    "--engines", "onnx-factored,transformers"])
    assert out.exit_code == 1 and out.stderr == ("error: `mla-deploy bench` needs the 'bench' extra (module "
                                                 f"'transformers' is not installed): {install_command('bench')}\n")
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("args,message", [
    (["--engines", "onnx-fused,torch_naive"], "--engines onnx-fused,torch_naive: expected some of onnx-fused, "),
    (["--batches", "0"], "--batches 0: expected integers >= 1"),
    (["--contexts", "128,-5"], "--contexts 128,-5: expected integers >= 1"),
])
def test_bad_engines_contexts_and_batches_fail_before_anything_is_built(tmp_path, args, message):
    out = CliRunner().invoke(main, ["bench", "--preset", "tiny-v3", "--workdir", str(tmp_path / "w"), *args])
    assert out.exit_code == 1 and out.stderr.startswith(f"error: {message}") and out.stderr.count("\n") == 1, \
        out.output
    assert not (tmp_path / "w").exists()
