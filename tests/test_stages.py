"""Staged exports (export --stages N): the plan's cut points, the stage graphs against the whole export's, the stages
chained in this process (runtime.chain) generating the whole export's tokens, each stage holding only its caches."""

import itertools
import json
import shutil

import numpy as np
import pytest

from mla_deploy import io_spec
from mla_deploy.checkpoint import Checkpoint
from mla_deploy.errors import ExportError, ExportLoadError
from mla_deploy.export import ExportOptions, ExportPlan, export
from mla_deploy.export.plan import balanced_stages, stored_bytes
from mla_deploy.manifest import check_export, read_manifest, read_stage
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime.chain import StageChain
from mla_deploy.runtime.feeds import prefill_feed
from mla_deploy.runtime.pipeline import PipelineGenerator
from mla_deploy.verify import verify_export
from test_stop import generate_ending

PROMPTS = [[5, 9, 200, 7, 31], [3] * 17, [44, 45, 46, 47, 48, 49, 50, 51, 52], [8], list(range(100, 130))]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The demo model whole, in 2 stages and in 3; and int4 (tied embedding quantized on both ends) whole and in 2."""
    root = tmp_path_factory.mktemp("stages")
    built = {}
    # the whole exports leave out the MTP draft graph as stage exports do, so both prefill graphs run the last MLP
    # at the logits positions only and output no hidden state for a draft
    for name, options in {"whole": ExportOptions(draft=False), "2": ExportOptions(stages=2),
                          "3": ExportOptions(stages=3), "int4": ExportOptions(quantize="int4", draft=False),
                          "int4-2": ExportOptions(quantize="int4", stages=2)}.items():
        built[name] = root / name
        export(DEMO_CHECKPOINT, built[name], options)
    return built


def greedy(model_or_chain, micro_batches=None):
    if micro_batches is None:
        return Generator(model_or_chain, SamplingParams(), stop_token_ids=()).generate(PROMPTS, 24).token_ids
    return PipelineGenerator(model_or_chain, SamplingParams(), stop_token_ids=(),
                             micro_batches=micro_batches).generate(PROMPTS, 24).token_ids


def test_the_cut_points_make_the_largest_stage_as_small_as_any_cut_can():
    rng = np.random.default_rng(0)
    for _ in range(30):
        n, count = int(rng.integers(1, 8)), int(rng.integers(1, 4))
        if count > n:
            continue
        layers, embedding, head = list(rng.uniform(1, 10, n)), float(rng.uniform(0, 10)), float(rng.uniform(0, 10))
        stages = balanced_stages(embedding, layers, head, count)
        assert [s.index for s in stages] == list(range(count)) and all(s.count == count for s in stages)
        assert stages[0].first_layer == 0 and stages[-1].end_layer == n
        assert all(a.end_layer == b.first_layer for a, b in zip(stages, stages[1:]))
        assert all(len(s.layers) >= 1 for s in stages)

        def largest(bounds):
            return max(sum(layers[a:b]) + embedding * (k == 0) + head * (k == count - 1)
                       for k, (a, b) in enumerate(zip(bounds, bounds[1:])))

        best = min(largest((0, *cuts, n)) for cuts in itertools.combinations(range(1, n), count - 1))
        assert largest((0, *[s.end_layer for s in stages])) == pytest.approx(best)


def test_a_stage_count_the_model_cannot_fill_is_refused_by_name(tmp_path):
    cfg = Checkpoint(DEMO_CHECKPOINT).config  # 4 layers
    with pytest.raises(ExportError, match="--stages 5: the model has 4 layers, and every stage needs at least one"):
        ExportPlan.resolve(cfg, ExportOptions(stages=5))
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ExportError, match="--stages .*: expected a positive integer"):
            export(tmp_path / "no-such-checkpoint", tmp_path / "out", ExportOptions(stages=bad))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["2", "3", "int4-2"])
def test_the_manifests_record_the_stages_and_each_stage_loads_as_an_export(exports, name):
    manifest = read_manifest(exports[name])
    plan = ExportPlan.from_manifest(manifest)
    cfg = manifest["config_obj"]
    count = len(plan.stages)
    assert plan.stages == ExportPlan.resolve(cfg, ExportOptions(stages=count, quantize=manifest["quantization"] and
                                                                "int4")).stages
    assert "graphs" not in manifest and [e["directory"] for e in manifest["stages"]] == [f"stage-{i}"
                                                                                           for i in range(count)]
    layers = []
    for index, stage in enumerate(plan.stages):
        directory, own = read_stage(exports[name], manifest, index)
        model = ExportedModel(directory)
        assert model.stage == stage and own["stage"]["staged_export_id"] == manifest["export_id"]
        names = {s.name for s in model.graph_io(io_spec.PREFILL)[0]}
        assert (io_spec.INPUT_IDS in names, io_spec.HIDDEN_STATES in names) == (stage.first, not stage.first)
        assert (io_spec.LOGITS_POSITIONS in names) == stage.last
        caches = io_spec.CacheFormat().tensors(stage.layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        assert {n for n in names if n.startswith("past_")} == {t.past for t in caches}
        layers += list(stage.layers)
    assert layers == list(range(cfg.num_hidden_layers))
    assert check_export(exports[name])["bytes"] == sum(e["weights_bytes"] for e in manifest["stages"])
    with pytest.raises(ExportLoadError, match=f"a staged export of {count} stages"):
        ExportedModel(exports[name])


@pytest.mark.parametrize("name, whole_name, largest", [("2", "whole", 0.6), ("int4-2", "int4", 0.7)])
def test_two_stages_split_the_weights_as_the_plan_reckons(exports, name, whole_name, largest):
    """The plan cuts by stored_bytes' reckoning, which counts each tensor as written, the absorbed decode form's
    (per-head codes, the queries' columns) included: within 5 % of each stage's weights.bin, float or int4. The
    tied table is stored on both ends (once in a whole int4 export, whose head reads the embedding's codes), and
    still the larger stage holds at most 60 % of the whole float export, 70 % of the int4 one (the table is a
    quarter of the demo's int4 bytes)."""
    whole = read_manifest(exports[whole_name])["weights"]["bytes"]
    manifest = read_manifest(exports[name])
    written = [e["weights_bytes"] for e in manifest["stages"]]
    assert max(written) / whole <= largest
    embedding, layers, head = stored_bytes(manifest["config_obj"], ExportPlan.from_manifest(manifest))
    for stage, nbytes in zip(ExportPlan.from_manifest(manifest).stages, written):
        reckoned = embedding * stage.first + sum(layers[i] for i in stage.layers) + head * stage.last
        assert reckoned == pytest.approx(nbytes, rel=0.05)


@pytest.mark.parametrize("name,whole", [("2", "whole"), ("3", "whole"), ("int4-2", "int4")])
def test_the_stages_chained_give_the_whole_graphs_outputs(exports, name, whole):
    model, chain = ExportedModel(exports[whole]), StageChain(exports[name])
    cfg = model.config
    ids = np.array([[5, 9, 200, 7, 31, 1], [3, 4, 5, 0, 0, 0]], np.int64)
    feed = prefill_feed(cfg, ids, 16, model.cache_dtype)
    feed[io_spec.LOGITS_POSITIONS] = np.array([[0, 5], [1, 2]], np.int64)
    expected, got = model.run(io_spec.PREFILL, feed), chain.run(io_spec.PREFILL, feed)
    assert got.keys() == expected.keys()
    scale = np.abs(expected[io_spec.LOGITS]).max()
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-4 * max(scale, 1.0), err_msg=key)


@pytest.mark.parametrize("name,whole", [("2", "whole"), ("3", "whole"), ("int4-2", "int4")])
def test_the_chained_stages_generate_the_whole_exports_tokens(exports, name, whole):
    expected = greedy(ExportedModel(exports[whole]))
    chain = StageChain(exports[name])
    # the int4 kernels' arithmetic depends on how many rows a call multiplies (its blocking), so a near tie may flip
    # when micro-batches split the rows one by one (5); float arithmetic is the same for any split
    for micro_batches in (1, 2, 5) if whole == "whole" else (1, 2):
        assert greedy(chain, micro_batches) == expected
    assert all(not worker.groups for worker in chain.workers)  # every group's caches freed at the end


def test_each_stage_holds_only_its_layers_caches(exports):
    chain = StageChain(exports["3"])
    ids = np.array([[5, 9, 200]], np.int64)
    chain.forward("g", io_spec.PREFILL, ids, np.arange(3)[None], np.zeros(1, np.int64), np.array([2]))
    for worker in chain.workers:
        cfg = worker.model.config
        caches = io_spec.CacheFormat().tensors(worker.stage.layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        assert set(worker.groups["g"].arrays) == {t.past for t in caches}
    chain.close("g")
    assert all(not worker.groups for worker in chain.workers)


def test_sampling_over_stages_follows_the_seed(exports):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    chain = StageChain(exports["2"])
    first = PipelineGenerator(chain, params, micro_batches=1).generate(PROMPTS[:1], 16).token_ids
    again = PipelineGenerator(chain, params, micro_batches=1).generate(PROMPTS[:1], 16).token_ids
    single = Generator(ExportedModel(exports["whole"]), params).generate(PROMPTS[:1], 16).token_ids
    assert first == again == single  # one row, one seeded draw per step: the whole export's draws
    whole = Generator(ExportedModel(exports["whole"]), params).generate(PROMPTS, 16)
    for micro_batches in (1, 2):  # each row draws from its own generator (row_generator), wherever its group runs
        staged = PipelineGenerator(chain, params, micro_batches=micro_batches).generate(PROMPTS, 16)
        assert staged.token_ids == whole.token_ids, micro_batches
        assert staged.decode_tokens == whole.decode_tokens  # the rows still generating, not every row launched


def test_verify_runs_the_stages_against_the_torch_source(exports):
    report = verify_export(exports["3"], steps=4)
    assert report.passed, report.lines
    assert any("runtime greedy vs torch greedy" in line for line in report.lines)


def test_stages_of_different_exports_are_refused(exports, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(exports["2"], mixed)
    shutil.rmtree(mixed / "stage-1")
    shutil.copytree(exports["int4-2"] / "stage-1", mixed / "stage-1")
    with pytest.raises(ExportLoadError, match="stage-1: not stage 1 .* stages of different exports cannot be mixed"):
        StageChain(mixed)
    manifest = json.loads((exports["2"] / "manifest.json").read_text())
    swapped = json.loads((mixed / "stage-1" / "manifest.json").read_text())
    assert manifest["stages"][1]["export_id"] != swapped["export_id"]


def test_inspect_reports_every_stage(exports):
    from mla_deploy.inspection import format_report, inspect_path

    report = inspect_path(exports["2"])
    assert set(report["graphs"]) == {f"stage {i} {kind}" for i in (0, 1) for kind in (io_spec.PREFILL, io_spec.DECODE)}
    assert report["weights_file_bytes"] == sum(e["weights_bytes"] for e in read_manifest(exports["2"])["stages"])
    assert report["damage"] is None
    assert "2 stages, layers 0-1, 2-3" in "\n".join(format_report(report))


def test_one_stage_directory_is_refused_where_the_whole_model_is_needed(exports, monkeypatch):
    """A stage's graphs take or give hidden states: generation, serving, verify and eval over one name the staged
    export to pass instead of failing inside onnxruntime; the commands before loading any graph."""
    import onnxruntime as ort
    from click.testing import CliRunner

    from mla_deploy.cli import main
    from mla_deploy.runtime.scheduler import Scheduler

    staged = exports["2"]
    for index in (0, 1):
        model = ExportedModel(staged / f"stage-{index}")  # a stage loads (StageChain and the Ray actors do so)
        said = rf"stage-{index}: stage {index} of 2 \(layers \d+-\d+\) of a staged export; "
        with pytest.raises(ExportLoadError, match=said + r"generation runs the whole model: pass the staged export's"):
            Generator(model)
        with pytest.raises(ExportLoadError, match=said + "serving runs the whole model"):
            Scheduler(model)
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: pytest.fail("a graph loaded"))
    for index in (0, 1):
        for command in (["run", str(staged / f"stage-{index}"), "--prompt-ids", "5,6", "-n", "2"],
                        ["chat", str(staged / f"stage-{index}")], ["serve", str(staged / f"stage-{index}")],
                        ["verify", str(staged / f"stage-{index}")]):
            result = CliRunner().invoke(main, command, input="")
            assert result.exit_code != 0 and "Traceback" not in result.output, result.output
            assert f"of a staged export; {command[0]} runs the whole model: pass the staged export's directory " \
                   f"({staged})" in result.output, result.output
    from mla_deploy.presets import DEMO_CHECKPOINT

    whole = CliRunner().invoke(main, ["eval", str(staged), "--text", str(DEMO_CHECKPOINT / "heldout.txt")])
    assert whole.exit_code == 1 and "a staged export; eval scores a whole export in this process" in whole.output


def test_ray_options_are_refused_where_nothing_runs_on_ray(exports):
    from click.testing import CliRunner

    from mla_deploy.cli import main

    result = CliRunner().invoke(main, ["serve", str(exports["2"]), "--ray-replicas", "2"])
    assert result.exit_code == 2 and "already runs as one Ray actor per stage" in result.stderr
    result = CliRunner().invoke(main, ["serve", str(exports["whole"]), "--micro-batches", "2"])
    assert result.exit_code == 2 and "only a staged export" in result.stderr
    result = CliRunner().invoke(main, ["run", str(exports["2"]), "--prompt-ids", "5,6", "--decode-only"])
    assert result.exit_code == 2 and result.stderr.startswith("error: --decode-only: a staged export's"), result.output
    result = CliRunner().invoke(main, ["serve", str(exports["2"]), "--cache-reuse", "16"])
    assert result.exit_code == 2 and "a staged export prefills every prompt whole" in result.stderr, result.output
    for command in (["run", str(exports["whole"]), "--prompt-ids", "5,6"], ["serve", str(exports["whole"])]):
        result = CliRunner().invoke(main, [*command, "--ray-address", "auto"])  # was ignored: it ran in process
        assert result.exit_code == 2 and result.stderr.startswith("error: --ray-address: only a staged export"), \
            result.output
    for mode in ("lookup", "mtp"):  # run and serve refuse them alike, before loading (Ray or not)
        for command in (["run", str(exports["2"]), "--prompt-ids", "5,6"], ["serve", str(exports["2"])]):
            result = CliRunner().invoke(main, [*command, "--speculative", mode])
            assert result.exit_code == 2 and result.stderr.startswith(
                f"error: --speculative {mode}: a staged export (export --stages N) decodes without speculation"), \
                result.output


def test_a_first_token_mask_applies_over_stages_as_in_the_whole_export(exports):
    mask = np.ones((len(PROMPTS), 4096), bool)
    mask[:, :1000] = False  # every row's first token from the ids 1000 and up
    expected = Generator(ExportedModel(exports["whole"]), SamplingParams(), stop_token_ids=()).generate(
        PROMPTS, 8, mask).token_ids
    got = PipelineGenerator(StageChain(exports["2"]), SamplingParams(), stop_token_ids=(), micro_batches=2).generate(
        PROMPTS, 8, mask).token_ids
    assert got == expected and all(row[0] >= 1000 for row in got)


def test_rows_ended_by_the_consumer_over_stages_end_as_in_the_whole_export(exports):
    end_at = {0: 2, 2: 0, 4: 5}
    expected, _ = generate_ending(Generator(ExportedModel(exports["whole"]), SamplingParams(), stop_token_ids=()),
                                  PROMPTS, 8, end_at)
    for micro_batches in (1, 2):
        got, _ = generate_ending(PipelineGenerator(StageChain(exports["2"]), SamplingParams(), stop_token_ids=(),
                                                   micro_batches=micro_batches), PROMPTS, 8, end_at)
        assert got.token_ids == expected.token_ids and got.finish_reasons == expected.finish_reasons
    assert [len(t) for t in expected.token_ids] == [3, 8, 1, 8, 6]
    assert expected.finish_reasons == ["stop", "length", "stop", "length", "stop"]
