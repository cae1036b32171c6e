"""Bad input gets a specific error; nothing half-written; safe to share between threads; reproducible."""

import errno
import filecmp
import gc
import json
import os
import shutil
import threading
import weakref
from pathlib import Path

import numpy as np
import psutil
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from mla_deploy import io_spec
from mla_deploy.cli import main
from mla_deploy.errors import CheckpointError, ExportError, ExportLoadError, InputError, ProviderError
from mla_deploy.export import ExportOptions, export
from mla_deploy.modeling import load_model
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams
from mla_deploy.runtime.feeds import empty_caches
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime.session import resolve_providers
from poison import poisoned_copy
from reference import torch_greedy

VARIANT = "v3_lora_group_yarn"


@pytest.fixture(scope="module")
def model(exported):
    return ExportedModel(exported(VARIANT))


# ---- runtime input validation ----
@pytest.mark.parametrize(
    "prompts, n, message",
    [
        ([[5, 97]], 3, r"prompt 0, position 1: token id 97 is outside the vocabulary \[0, 97\)"),
        ([[5, -1]], 3, r"token id -1 is outside the vocabulary"),
        ([[]], 3, r"prompt 0: empty"),
        ([], 3, r"^prompts: expected a non-empty list of token-id lists$"),
        (5, 3, r"^prompts: expected a non-empty list of token-id lists$"),
        ([[5, 6], "abc"], 3, r"prompt 1: expected a list of token ids, got str"),
        ([[5, 2.5]], 3, r"prompt 0, position 1: token id 2.5 is not an integer"),
        (
            [list(range(3, 90)) * 3],
            3,
            r"261 prompt tokens \+ 3 new tokens = 264 exceeds the export's maximum length 256",
        ),
        ([[5]], 0, r"max_new_tokens=0: must be a positive integer"),
        ([[5]], True, r"max_new_tokens=True: must be a positive integer"),
        ([[5]], "3", r"max_new_tokens='3': must be a positive integer"),
    ],
)
def test_bad_prompts_refused_before_onnxruntime(model, prompts, n, message):
    with pytest.raises(InputError, match=message):
        Generator(model).generate(prompts, n)


def test_prompts_as_numpy_arrays_and_a_flat_list_are_rows(model):
    greedy = Generator(model, SamplingParams(), stop_token_ids=())
    rows = greedy.generate([[5, 6, 7], [8, 9, 10]], 2).token_ids
    assert greedy.generate(np.array([[5, 6, 7], [8, 9, 10]]), 2).token_ids == rows
    assert greedy.generate([np.array([5, 6, 7]), np.array([8, 9, 10])], 2).token_ids == rows
    assert greedy.generate(np.array([5, 6, 7]), 2).token_ids == rows[:1]
    assert greedy.generate([5, 6, 7], 2).token_ids == rows[:1]
    assert greedy.generate(np.array(5), 2).token_ids == greedy.generate([5], 2).token_ids  # a 0-d array: one token


@pytest.mark.parametrize("chunk_size", [0, -3, 2.5, "8"])
def test_generator_chunk_size_must_be_a_positive_int(model, chunk_size):
    with pytest.raises(InputError, match=rf"^chunk_size={chunk_size!r}: must be a positive integer$"):
        Generator(model, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(temperature=-0.5), "temperature=-0.5: must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(top_p=0.0), r"top_p=0.0: must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5: must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k=-1: must be an integer >= 0"),
        (dict(top_k=2.5), "top_k=2.5: must be an integer >= 0"),
        (dict(top_k=True), "top_k=True: must be an integer >= 0"),
        (dict(repetition_penalty=0), "repetition_penalty=0: must be a finite number > 0"),
        (dict(seed=-3), "seed=-3: must be a non-negative integer"),
    ],
)
def test_sampling_parameters_out_of_range(model, params, message):
    with pytest.raises(InputError, match=message):
        Generator(model, SamplingParams(**params))


def test_settings_given_as_other_types_are_named(model):
    """A dict for the sampling, a mode's name for the speculation: an InputError saying what the API takes, not an
    AttributeError from inside it (complete(), Generator and PipelineGenerator, Conversation share the check)."""
    from mla_deploy.runtime.complete import complete

    with pytest.raises(InputError, match=r"sampling: expected a SamplingParams \(or None\), got dict"):
        complete(model, prompt_ids=[1, 2], sampling={"temperature": 0})
    with pytest.raises(InputError, match=r"speculation: expected a Speculation \(or None\), got str 'lookup'"):
        Generator(model, speculation="lookup")


@pytest.mark.parametrize("stops, message", [
    ("2", r"^stop_token_ids: expected a list of token ids, got str '2'$"),  # was {'2'}: the export's EOS unheeded
    (2, r"^stop_token_ids: expected a list of token ids, got int 2$"),
    ([2, 97], r"^stop_token_ids: token id 97 is outside the vocabulary \[0, 97\)$"),
    ([-5], r"^stop_token_ids: token id -5 is outside the vocabulary"),
    ([2.0], r"^stop_token_ids: 2.0 is not an integer token id$"),
])
def test_stop_token_ids_are_checked(model, stops, message):
    with pytest.raises(InputError, match=message):
        Generator(model, stop_token_ids=stops)
    assert Generator(model, stop_token_ids=np.array([2, 3])).stop_token_ids == {2, 3}


@pytest.mark.parametrize("graphs", [(), ("verify",)])
def test_a_generator_over_neither_prefill_nor_decode_is_refused(exported, graphs):
    with pytest.raises(InputError, match="^a Generator runs the prefill or the decode graph: load the model with"):
        Generator(ExportedModel(exported(VARIANT), graphs=graphs))


def test_threads_past_four_per_cpu_are_refused_before_onnxruntime_makes_them(exported):
    from mla_deploy.runtime import RuntimeOptions

    cpus = os.cpu_count() or 1
    with pytest.raises(InputError, match=rf"threads={4 * cpus + 1}: more than 4 per logical CPU of this machine's "
                                         rf"{cpus}; 0 takes one per physical core"):
        ExportedModel(exported(VARIANT), RuntimeOptions(threads=4 * cpus + 1))
    assert ExportedModel(exported(VARIANT), RuntimeOptions(threads=4 * cpus), graphs=("decode",)).sessions


def test_a_reader_that_closes_stdout_early_ends_the_run_quietly(demo_export_dir):
    """`mla-deploy run ... | head -c 5`: the pipe's end is the reader's choice, not an error: no message, and the exit
    status a shell gives a writer the pipe ended (128 + SIGPIPE)."""
    import subprocess
    import sys

    cli = shutil.which("mla-deploy", path=os.path.dirname(sys.executable))
    run = subprocess.Popen([cli, "run", str(demo_export_dir), "--prompt", "def ", "-n", "400", "--seed", "1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert run.stdout.read(5)
    run.stdout.close()
    assert run.wait(timeout=120) == 141
    assert run.stderr.read() == b""


def good_feed(model, b=2, t=3, cap=8):
    cfg = model.config
    feed = {io_spec.INPUT_IDS: np.full((b, t), 5, np.int64), io_spec.POSITION_IDS: np.tile(np.arange(t), (b, 1)),
            io_spec.ATTENTION_MASK: np.ones((b, cap), np.int64), io_spec.WRITE_INDICES: np.zeros(b, np.int64),
            io_spec.LOGITS_POSITIONS: np.full((b, 1), t - 1, np.int64)}
    feed.update(empty_caches(cfg, b, cap))
    return feed


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda f: f.update({"past_latent.1": f["past_latent.1"].astype(np.float64)}),
            "^past_latent.1: dtype float64, expected float32: numpy float32$",
        ),
        (
            lambda f: f.update({"past_latent.0": np.zeros((2, 8, 31), np.float32)}),
            r"^past_latent.0: shape \[2, 8, 31\], expected \['batch', 'capacity', 32\]$",
        ),
        (
            lambda f: f.update({io_spec.INPUT_IDS: [[5, 5, 5], [5, 5, 5]]}),
            "^input_ids: expected a numpy array, got list$",
        ),
        (
            lambda f: f.update({io_spec.INPUT_IDS: np.full((2, 3, 1), 5)}),
            r"^input_ids: shape \[2, 3, 1\], expected rank 2 \['batch', 'seq'\]$",
        ),
        (
            lambda f: f.update({"past_latent.9": np.zeros((2, 8, 32), np.float32)}),
            r"^prefill inputs: missing \[\], unknown \['past_latent.9'\]$",
        ),
        (
            lambda f: f.update({"past_rope.0": np.zeros((2, 8, 5), np.float32)}),
            r"past_rope.0: shape \[2, 8, 5\], expected \['batch', 'capacity', 8\]",
        ),
        (
            lambda f: f.update({"past_latent.2": np.zeros((3, 8, 32), np.float32)}),
            "past_latent.2: batch is 3 but input_ids has batch 2: the inputs disagree",
        ),
        (
            lambda f: f.update({"past_rope.2": np.zeros((2, 9, 8), np.float32)}),
            "past_rope.2: capacity is 9 but attention_mask has capacity 8",
        ),
        (lambda f: f.pop("past_rope.1"), r"^prefill inputs: missing \['past_rope.1'\], unknown \[\]$"),
        (lambda f: f.update({io_spec.WRITE_INDICES: np.array([0, 6])}), r"do not fit a cache of capacity 8"),
        (
            lambda f: f.update({io_spec.INPUT_IDS: np.array([[5, 5, 5], [5, 500, 5]])}),
            r"input_ids\[1, 1\] = 500: outside the vocabulary",
        ),
        (
            lambda f: f.update({io_spec.POSITION_IDS: np.full((2, 3), 300)}),
            r"position_ids: values must be in \[0, 256\)",
        ),
        (
            lambda f: f.update({io_spec.POSITION_IDS: np.array([[0, 1, 2], [253, 254, 256]])}),
            r"position_ids: values must be in \[0, 256\) \(the export's maximum length\), got \[0, 256\]",
        ),
        (lambda f: f.update({io_spec.POSITION_IDS: np.array([[-1, 0, 1], [0, 1, 2]])}), r"got \[-1, 2\]"),
        (
            lambda f: f.update({io_spec.INPUT_IDS: np.array([[5, 5, 97], [5, 5, 5]])}),
            r"input_ids\[0, 2\] = 97: outside the vocabulary \[0, 97\)",
        ),
        (
            lambda f: f.update(
                {io_spec.INPUT_IDS: np.zeros((2, 0), np.int64), io_spec.POSITION_IDS: np.zeros((2, 0), np.int64)}
            ),
            "input_ids: empty; at least one token per row",
        ),
        (
            lambda f: f.update({io_spec.LOGITS_POSITIONS: np.array([[2], [3]])}),
            r"logits_positions: values must be in \[0, 3\), got \[2, 3\]",
        ),
    ],
)
def test_caches_and_feeds_checked_through_the_api(model, change, message):
    feed = good_feed(model)
    change(feed)
    with pytest.raises(InputError, match=message):
        model.run(io_spec.PREFILL, feed)


def test_good_feed_runs(model):
    out = model.run(io_spec.PREFILL, good_feed(model))
    assert out[io_spec.LOGITS].shape == (2, 1, model.config.vocab_size)


def test_unknown_provider_and_missing_cuda():
    with pytest.raises(ProviderError, match="unknown provider 'tpu'"):
        resolve_providers("tpu")
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.warns(RuntimeWarning, match="CUDAExecutionProvider.*not available.*falling back to CPU"):
            assert resolve_providers("cuda") == ["CPUExecutionProvider"]


# ---- export side ----
def test_export_refuses_an_earlier_export_unless_forced(checkpoint_dir, tmp_path):
    src, _ = checkpoint_dir(VARIANT)
    out = tmp_path / "out"
    export(src, out)
    (out / "keep.txt").write_text("left in the earlier export")
    with pytest.raises(ExportError, match="output directory exists \\(use --force"):
        export(src, out)
    assert (out / "keep.txt").exists()
    export(src, out, ExportOptions(force=True))
    assert not (out / "keep.txt").exists() and (out / "manifest.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no partial or old copy left beside it


def test_export_into_an_empty_directory_fills_it(checkpoint_dir, tmp_path):
    """An empty directory (`mktemp -d`, a mounted volume's folder) holds nothing to replace: the export goes there
    without --force; one holding anything is refused, untouched."""
    src, _ = checkpoint_dir(VARIANT)
    out = tmp_path / "out"
    out.mkdir()
    export(src, out, verify=None)
    assert (out / "manifest.json").exists() and [p.name for p in tmp_path.iterdir()] == ["out"]
    other = tmp_path / "other"
    (other / "empty").mkdir(parents=True)
    with pytest.raises(ExportError, match="other: is a directory with no manifest.json"):
        export(src, other)
    assert [p.name for p in other.iterdir()] == ["empty"]



def test_export_into_the_current_directory_builds_beside_it(checkpoint_dir, tmp_path, monkeypatch):
    """`-o .` in an empty directory: the build goes beside it, not into it (a hidden partial named from "" would
    land inside "." and leave it not empty); an empty directory whose parent cannot take the rename is refused
    before the checkpoint is read."""
    src, _ = checkpoint_dir(VARIANT)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    export(src, ".", verify=None)
    assert (here / "manifest.json").exists() and [p.name for p in tmp_path.iterdir()] == ["here"]
    monkeypatch.chdir(tmp_path)
    locked = tmp_path / "locked"
    (locked / "empty").mkdir(parents=True)
    export(src, locked / "earlier", verify=None)
    access = os.access  # a parent this process cannot write (root writes anywhere: its answer is set here)
    monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and Path(path) != locked)
    for out, force in ((locked / "empty", False), (locked / "earlier", True)):
        with pytest.raises(ExportError, match=f"{out}: cannot be replaced \\({locked} is not writable\\)"):
            export(src, out, ExportOptions(force=force), verify=None)
    with pytest.raises(ExportError, match="output directory exists"):  # without --force: that, first
        export(src, locked / "earlier", verify=None)
    assert sorted(p.name for p in locked.iterdir()) == ["earlier", "empty"]


def _tree(root: Path) -> dict:
    """Every path under root (links not followed) with its bytes, or its target for a link."""
    tree = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        tree[rel] = ("link", os.readlink(path)) if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    return tree


@pytest.mark.parametrize("kind,what", [
    ("file", "is a file"), ("directory", "is a directory with no manifest.json (not an mla-deploy export)"),
    ("foreign manifest", "is a directory whose manifest.json is not an mla-deploy manifest"),
    ("broken manifest", "is a directory whose manifest.json is unreadable or not JSON"),
    ("link to an export", "is a symbolic link"),
])
def test_force_replaces_only_an_earlier_export(checkpoint_dir, exported, tmp_path, kind, what):
    """Whatever else lies at the output path is refused by name, with or without --force, and nothing is deleted."""
    src, _ = checkpoint_dir(VARIANT)
    work = tmp_path / "work"
    work.mkdir()
    out = work / "out"
    if kind == "file":
        out.write_text("my notes")
    elif kind == "link to an export":
        out.symlink_to(exported(VARIANT), target_is_directory=True)
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        if kind != "directory":
            (out / "manifest.json").write_text(
                '{"format": "another tool"}' if kind == "foreign manifest" else "{not json"
            )
    before, linked = _tree(work), _tree(exported(VARIANT))
    for force in (False, True):
        with pytest.raises(ExportError) as refused:
            export(src, out, ExportOptions(force=force))
        message = str(refused.value)
        assert message.startswith(f"{out}: {what}; ") and message.endswith("choose another output path")
        assert ("--force replaces only an earlier mla-deploy export, so nothing was deleted" in message) == force
        assert _tree(work) == before and _tree(exported(VARIANT)) == linked


def test_export_force_on_a_file_fails_in_one_line(checkpoint_dir, tmp_path):
    src, _ = checkpoint_dir(VARIANT)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    result = CliRunner().invoke(main, ["export", str(src), "-o", str(notes), "--force", "--no-verify"])
    assert result.exit_code == 1 and notes.read_text() == "mine"
    assert result.stderr == (f"error: {notes}: is a file; --force replaces only an earlier mla-deploy export, so "
                             "nothing was deleted: choose another output path\n")


def test_export_without_a_tokenizer_says_what_it_cannot_do(checkpoint_dir, tmp_path):
    src, _ = checkpoint_dir(VARIANT)
    assert not (src / "tokenizer.json").exists()
    result = CliRunner().invoke(main, ["export", str(src), "-o", str(tmp_path / "out"), "--no-verify"])
    assert result.exit_code == 0, result.output
    assert (f"note: {src}: no tokenizer.json, so the export takes token ids alone (`run --prompt-ids`, `eval --ids`); "
            "text" in result.output), result.output
    assert "tokenizer.json" not in json.loads((tmp_path / "out" / "manifest.json").read_text())["tokenizer"]


def test_disk_full_mid_write_leaves_nothing(checkpoint_dir, tmp_path, monkeypatch):
    from mla_deploy.export.weights import WeightsFile

    src, _ = checkpoint_dir(VARIANT)
    real, written = WeightsFile.tensor, []

    def full(self, name, make, dtype="float32"):
        if len(written) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(name)
        return real(self, name, make, dtype)

    monkeypatch.setattr(WeightsFile, "tensor", full)
    with pytest.raises(
        ExportError, match="writing the export failed \\(No space left on device\\); nothing was left behind"
    ):
        export(src, tmp_path / "out")
    assert len(written) == 3 and list(tmp_path.iterdir()) == []


def test_export_refuses_bad_checkpoints(checkpoint_dir, tmp_path):
    src, _ = checkpoint_dir(VARIANT)
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:1000])
    with pytest.raises(CheckpointError, match="truncated"):
        export(bad, tmp_path / "out")
    shutil.copyfile(src / "model.safetensors", bad / "model.safetensors")
    (bad / "generation_config.json").write_text("[1]")  # copied into the export: refused before any graph is written
    with pytest.raises(CheckpointError, match="generation_config.json: generation config must be a JSON object"):
        export(bad, tmp_path / "out", verify=lambda d: pytest.fail("the export went on to verify"))
    (bad / "generation_config.json").unlink()
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {')  # the runtime could not load it
    with pytest.raises(CheckpointError, match=r"tokenizer.json: cannot read tokenizer \(EOF while parsing"):
        export(bad, tmp_path / "out", verify=lambda d: pytest.fail("the export went on to verify"))
    (bad / "tokenizer.json").unlink()
    (bad / "model.safetensors").unlink()
    (bad / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(CheckpointError, match="only pickle weights found"):
        export(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- load side ----
def _edit_manifest(directory, **fields):
    manifest = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**manifest, **fields}))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "decode.onnx").unlink(), r"decode.onnx: missing decode graph"),
        (lambda d: (d / "weights.bin").unlink(), r"weights.bin: missing external weight data"),
        (
            lambda d: (d / "weights.bin").write_bytes((d / "weights.bin").read_bytes()[:-100]),
            r"weights.bin: \d+ bytes, the manifest says",
        ),
        (lambda d: (d / "prefill.onnx").write_bytes(b"garbage"), r"prefill.onnx: does not match the manifest"),
        (lambda d: (d / "manifest.json").write_text("{not json"), r"manifest.json: corrupt manifest"),
        (lambda d: (d / "manifest.json").unlink(), r"manifest.json: missing"),
        (lambda d: _edit_manifest(d, dtype="int3"), r"invalid manifest \(dtype 'int3': expected one of float32"),
        (lambda d: _edit_manifest(d, precision={"caches": "int2"}), r"invalid manifest \(latent cache dtype 'int2'"),
    ],
)
def test_damaged_exports_refused_naming_the_file(exported, tmp_path, damage, message):
    d = tmp_path / "export"
    shutil.copytree(exported(VARIANT), d)
    damage(d)
    with pytest.raises(ExportLoadError, match=message):
        ExportedModel(d)


def test_check_names_every_damaged_file_at_once(exported, tmp_path):
    """A graph changed, another gone and the weights damaged: `check` (and a load) names all three, so one repair
    is not followed by the next refusal."""
    d = tmp_path / "export"
    shutil.copytree(exported(VARIANT), d)
    (d / "decode.onnx").write_bytes((d / "decode.onnx").read_bytes() + b"\0")
    (d / "verify.onnx").unlink()
    with open(d / "weights.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    result = CliRunner().invoke(main, ["check", str(d)])
    assert result.exit_code != 0 and "Traceback" not in result.output
    error = result.output.strip().splitlines()[-1]
    assert error.startswith("error: 3 files fail their check: "), result.output
    for said in ("decode.onnx: does not match the manifest", "verify.onnx: missing verify graph",
                 "weights.bin: corrupted: block 0"):
        assert said in error, (said, error)
    with pytest.raises(ExportLoadError, match="3 files fail their check"):
        ExportedModel(d)


def test_unreadable_export_files_named_not_an_internal_error(exported, tmp_path, monkeypatch):
    """A graph and the weights the user may not read (a permission error: opened for reading, refused): `check`,
    `verify` and a load name both files and the reason, as a one-line error, not `internal error: PermissionError`.
    The refusal is simulated at open() (tests may run as root, whom chmod does not stop)."""
    import builtins
    import errno
    import io

    d = tmp_path / "export"
    shutil.copytree(exported(VARIANT), d)
    refused = {str(d / "decode.onnx"), str(d / "weights.bin")}
    real_open = io.open

    def open_refusing(file, *args, **kwargs):
        if str(file) in refused:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", open_refusing)
    monkeypatch.setattr(builtins, "open", open_refusing)
    for command in ("check", "verify"):
        result = CliRunner().invoke(main, [command, str(d)])
        assert result.exit_code == 1 and "Traceback" not in result.output, result.output
        error = result.output.strip().splitlines()[-1]
        assert error.startswith("error: 2 files fail their check: "), error
        assert "decode.onnx: cannot read the decode graph (Permission denied)" in error, error
        assert "weights.bin: cannot read the weights (Permission denied)" in error, error
    with pytest.raises(ExportLoadError, match=r"weights.bin: cannot read the weights \(Permission denied\)"):
        ExportedModel(d)


def test_corrupt_graph_with_matching_hash_named(exported, tmp_path):
    import hashlib

    d = tmp_path / "export"
    shutil.copytree(exported(VARIANT), d)
    (d / "prefill.onnx").write_bytes(b"\x08\x07garbage-protobuf")
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["graphs"]["prefill"]["sha256"] = hashlib.sha256((d / "prefill.onnx").read_bytes()).hexdigest()
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportLoadError, match="prefill.onnx: onnxruntime cannot load this graph"):
        ExportedModel(d)


def test_non_finite_logits_are_refused_not_sampled(exported, tmp_path):
    """A NaN in the final norm's weight makes every logit NaN: the Generator (greedy, sampling, penalties) and `run`
    say so by name instead of returning an arbitrary token."""
    from mla_deploy.errors import ModelOutputError

    d = poisoned_copy(exported(VARIANT), tmp_path / "export", "final_norm", 7)
    model = ExportedModel(d)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(repetition_penalty=1.2)):
        with pytest.raises(ModelOutputError, match=r"the model's logits hold NaN \(row 0 of 1\)"):
            Generator(model, params, stop_token_ids=()).generate([[5, 6, 7]], 3)
    result = CliRunner().invoke(main, ["run", str(d), "--prompt-ids", "5,6,7", "-n", "2"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("error: the model's logits hold NaN"), result.output


def test_a_request_whose_logits_go_nan_fails_alone(exported, tmp_path):
    """NaN in token 7's embedding: a request that meets token 7 (in its prompt, or generated and fed back) ends with
    Failed naming it, the other rows run on to their own tokens, and the failed row is zeroed for the next request
    (a masked NaN would still poison attention's sums)."""
    from mla_deploy.errors import ModelOutputError
    from mla_deploy.runtime.scheduler import Failed, Request, Scheduler

    cfg = ExportedModel(exported(VARIANT)).config
    model = ExportedModel(poisoned_copy(exported(VARIANT), tmp_path / "export", "embed", 7 * cfg.hidden_size))
    good = [5, 6, 8]
    alone = Generator(model, SamplingParams(), stop_token_ids=()).generate([good], 6).token_ids[0]
    assert 7 not in alone
    scheduler = Scheduler(model, max_batch=3)
    events = {name: [] for name in ("prompt", "generated", "good")}
    scheduler.add(Request([5, 7, 8], 6, events["prompt"].append))
    scheduler.add(Request(good, 6, events["generated"].append, SamplingParams(logit_bias=((7, 100.0),))))
    scheduler.add(Request(good, 6, events["good"].append))
    while scheduler.has_work():
        scheduler.step()
    for name, after in (("prompt", 0), ("generated", 1)):
        failed = events[name][-1]
        assert isinstance(failed, Failed) and isinstance(failed.error, ModelOutputError), events[name]
        assert f"after {after} tokens" in str(failed.error) and "logits hold NaN" in str(failed.error)
        assert len(events[name]) == 1 + after  # the tokens before it, then the failure: no Finished
    assert [e.token for e in events["good"][:-1]] == alone and events["good"][-1].reason == "length"
    assert scheduler.stats.finished["error"] == 2
    for array in scheduler.caches.arrays.values():
        assert np.isfinite(array.astype(np.float32)).all()
    again = []
    scheduler.add(Request(good, 6, again.append, SamplingParams(repetition_penalty=1.01)))  # no prefix reuse twin
    while scheduler.has_work():
        scheduler.step()
    assert again[-1].reason == "length" and len(again) == 7


def test_the_logits_check_reads_each_row_and_guards_speculation_too():
    """finite() names the first bad row; a masked (-inf) logit passes; accept_row's plain greedy argmax is checked."""
    from mla_deploy.errors import ModelOutputError
    from mla_deploy.runtime.sampling import finite
    from mla_deploy.runtime.speculative import accept_row

    logits = np.zeros((3, 10), np.float32)
    logits[1, 4] = -np.inf  # a masked logit is a probability of 0, not an error
    assert finite(logits) is logits
    for row, value, what in ((2, np.nan, "NaN"), (0, np.inf, "infinite values")):
        bad = logits.copy()
        bad[row, 3] = value
        with pytest.raises(ModelOutputError, match=f"hold {what} \\(row {row} of 3\\)"):
            finite(bad)
        with pytest.raises(ModelOutputError):
            accept_row(bad, [1, 1], SamplingParams(), np.array([1]), None, np.random.default_rng(0))
    empty = np.full((1, 10), -np.inf, np.float32)  # no finite value at all: nothing to sample
    with pytest.raises(ModelOutputError, match="infinite values"):
        finite(empty)


def test_newer_manifest_version_refused(exported, tmp_path):
    d = tmp_path / "export"
    shutil.copytree(exported(VARIANT), d)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["manifest_version"] = 99
    manifest["mla_deploy_version"] = "9.0.0"
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        ExportLoadError, match="manifest_version 99 was written by mla-deploy 9.0.0.*upgrade mla-deploy"
    ):
        ExportedModel(d)


# ---- properties ----
@st.composite
def greedy_requests(draw):
    """A valid request by construction: 1-5 rows of 1-60 in-vocabulary ids, 1-10 new tokens, a chunk size."""
    rows = draw(st.lists(st.lists(st.integers(0, 96), min_size=1, max_size=60), min_size=1, max_size=5))
    return rows, draw(st.integers(1, 64)), draw(st.integers(1, 10))


@pytest.mark.parametrize("absorb", ["fused", "factored"])
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=greedy_requests())
def test_runtime_greedy_equals_torch_greedy(checkpoint_dir, exported, absorb, request):
    prompts, chunk, n = request
    src, _ = checkpoint_dir(VARIANT)
    model = _loaded(exported(VARIANT, absorb))
    result = Generator(model, chunk_size=chunk, stop_token_ids=()).generate(prompts, n)
    assert len(result.token_ids) == len(prompts) and result.finish_reasons == ["length"] * len(prompts)
    torch_model = _torch_model(src)
    for prompt, got in zip(prompts, result.token_ids, strict=True):
        assert got == torch_greedy(torch_model, prompt, n)


_LOADED = {}


def _loaded(directory):
    if directory not in _LOADED:
        _LOADED[directory] = ExportedModel(directory)
    return _LOADED[directory]


_TORCH = {}


def _torch_model(src):
    if src not in _TORCH:
        _TORCH[src] = load_model(src)
    return _TORCH[src]


@pytest.mark.filterwarnings("error")  # an overflow or NaN inside sampling fails the test
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    temperature=st.one_of(st.floats(-1, 3), st.just(float("nan")), st.just(1e-300), st.just(1e300)),
    top_k=st.integers(-2, 120),
    top_p=st.floats(-0.5, 1.5),
    penalty=st.one_of(st.floats(0.0, 3.0), st.just(3.2302997040633257e-216), st.just(1e-310), st.just(1e300)),
    seed=st.integers(0, 2**31),
)
@example(temperature=1e-300, top_k=0, top_p=1.0, penalty=3.2302997040633257e-216, seed=0)  # found by CI: overflow
@example(temperature=0.5, top_k=3, top_p=0.5, penalty=1e-310, seed=1)  # a denormal penalty: logits past float64
def test_sampling_returns_tokens_in_vocab_or_refuses(model, temperature, top_k, top_p, penalty, seed):
    params = SamplingParams(temperature, top_k, top_p, penalty, seed)
    try:
        params.validate()
    except InputError:
        return
    a = Generator(model, params, stop_token_ids=()).generate([[5, 6, 7], [8]], 5)
    b = Generator(model, params, stop_token_ids=()).generate([[5, 6, 7], [8]], 5)
    assert a.token_ids == b.token_ids  # seeded: reproducible
    assert all(0 <= t < model.config.vocab_size for row in a.token_ids for t in row)


# ---- concurrency, soak, cancellation ----
def run_threads(work, n: int, timeout: float = 180) -> None:
    """work(i) in n threads; fails on any thread's exception or on a thread still running at the timeout."""
    errors = []

    def guarded(i):
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - reported below, with the thread it came from
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not [t for t in threads if t.is_alive()], f"threads still running after {timeout} s"
    assert errors == []


PROMPTS = [[3 + i, 10 + 2 * i, 40 - i] for i in range(6)]


def test_threads_sharing_one_model_get_what_they_get_alone(model):
    alone = [Generator(model, stop_token_ids=()).generate([p], 24).token_ids[0] for p in PROMPTS]
    results = [[] for _ in PROMPTS]

    def work(i):
        for _ in range(3):
            results[i].append(Generator(model, stop_token_ids=()).generate([PROMPTS[i]], 24).token_ids[0])

    run_threads(work, len(PROMPTS))
    assert results == [[row] * 3 for row in alone]


def test_threads_sharing_one_generator_get_what_they_get_alone(model):
    """The Generator holds no per-generation state: one seeded sampler serves every thread reproducibly."""
    gen = Generator(model, SamplingParams(temperature=0.9, top_k=30, seed=3), stop_token_ids=())
    alone = [gen.generate([p], 24).token_ids[0] for p in PROMPTS]
    assert len(set(map(tuple, alone))) > 1
    results = [[] for _ in PROMPTS]

    def work(i):
        for _ in range(3):
            results[i].append(gen.generate([PROMPTS[i]], 24).token_ids[0])

    run_threads(work, len(PROMPTS))
    assert results == [[row] * 3 for row in alone]


@pytest.fixture(scope="module")
def wide_cache_model(tmp_path_factory):
    """A tiny model with DeepSeek's latent width (kv_lora_rank 512): 1.6 MB of cache per 256-slot generation,
    so a cache leaked per generation is far above the noise of the resident-set size."""
    from tiny import build_hf_model, save_hf_model

    src = tmp_path_factory.mktemp("wide-src")
    save_hf_model(build_hf_model("v2_group_limited", kv_lora_rank=512), src)
    out = tmp_path_factory.mktemp("wide") / "export"
    export(src, out)
    return ExportedModel(out)


def test_soak_memory_flat_after_warmup(wide_cache_model):
    model = wide_cache_model
    gen = Generator(model, SamplingParams(temperature=0.8, seed=1), stop_token_ids=())
    process = psutil.Process()
    for _ in range(3):  # warm-up: arenas and caches reach their working size
        gen.generate([[5, 6, 7]], 200)
    gc.collect()
    before = process.memory_info().rss
    runs, tokens = 40, 0
    for i in range(runs):
        tokens += len(gen.generate([[5, 6, 7 + i % 50]], 200).token_ids[0])
    gc.collect()
    grown = process.memory_info().rss - before
    cfg = model.config
    cache_bytes = cfg.num_hidden_layers * 256 * cfg.latent_cache_width * 4  # one generation's buffers
    assert tokens == runs * 200
    assert grown < runs * cache_bytes / 2, (
        f"resident memory grew {grown / 2**20:.1f} MiB over {runs} generations "
        f"(a cache leaked per generation would be {runs * cache_bytes / 2**20:.0f} MiB)")


@pytest.fixture
def cache_arrays(monkeypatch):
    """Weak references to every cache buffer the runtime allocates from now on."""
    from mla_deploy.runtime.cache import CacheBuffers

    refs = []
    real = CacheBuffers.ensure

    def tracking(self, needed):
        grew = real(self, needed)
        refs.extend(weakref.ref(a) for a in self.arrays.values())
        return grew

    monkeypatch.setattr(CacheBuffers, "ensure", tracking)
    return refs


def test_closing_a_stream_frees_its_cache_buffers(model, cache_arrays):
    stream = Generator(model, stop_token_ids=()).stream([[5, 6, 7]], 100)
    next(stream), next(stream)
    assert cache_arrays and all(ref() is not None for ref in cache_arrays)
    stream.close()
    gc.collect()
    assert [ref for ref in cache_arrays if ref() is not None] == []


def test_a_stream_ended_by_an_error_frees_its_cache_even_while_the_error_is_kept(model, cache_arrays):
    """An app that keeps the exception (logging, retry) keeps its traceback, and with it the generator's frame:
    the buffers must still go."""
    stream = Generator(model, stop_token_ids=()).stream([[5, 6, 7]], 100)
    next(stream), next(stream)
    with pytest.raises(RuntimeError) as kept:
        stream.throw(RuntimeError("the consumer failed"))
    gc.collect()
    assert kept.value.__traceback__ is not None
    assert cache_arrays and [ref for ref in cache_arrays if ref() is not None] == []


# ---- reproducibility ----
def test_exporting_twice_gives_identical_files(checkpoint_dir, tmp_path):
    src, _ = checkpoint_dir(VARIANT)
    export(src, tmp_path / "a")
    export(src, tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "a", tmp_path / "b", names, shallow=False)
    assert mismatch == [] and errors == [] and sorted(match) == names


# ---- CLI ----
def test_eval_scores_an_export_without_a_tokenizer_from_token_ids(exported, tmp_path):
    out = exported(VARIANT)
    vocab = ExportedModel(out).config.vocab_size
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i * 7919 % vocab) for i in range(40)))
    result = CliRunner().invoke(main, ["eval", str(out), "--ids", str(ids), "--window", "16"])
    assert result.exit_code == 0, result.output
    assert "scored 39 tokens in 3 windows" in result.stdout and "top-1 agreement" in result.stdout


def test_cli_errors_are_one_line(exported):
    out = str(exported(VARIANT))
    runner = CliRunner()
    cases = [
        (["run", out, "--prompt-ids", "1,2,999"], "token id 999 is outside the vocabulary"),
        (["run", out, "--prompt-ids", "1,x"], "expected comma-separated integers"),
        (["run", out, "--prompt-ids", "1,,2"], "'1,,2': an empty id at position 2"),
        (["run", out, "--prompt-ids", "1,2", "--temperature", "-1"], "'--temperature': -1.0 is not in the range x>=0"),
        (["run", out, "--prompt-ids", "1,2", "--draft-tokens", "17"],
         "'--draft-tokens': 17 is not in the range 1<=x<=16"),
        (["run", out, "--prompt-ids", "1,2", "-n", "0"], "'--max-new-tokens': 0 is not in the range x>=1"),
        (["run", out, "--prompt", "hello"], "has no tokenizer; pass token ids"),
        (["eval", out, "--text", "/nonexistent.txt"], "has no tokenizer to read text: give the text as token ids"),
        (["run", out], "give one of --prompt TEXT or --prompt-ids IDS"),
        (["run", out, "--prompt", "x", "--prompt-ids", "1"], "give one of --prompt TEXT or --prompt-ids IDS, not both"),
        (["run", "/nonexistent/export", "--prompt-ids", "1"], "export directory does not exist"),
        (["export", "/nonexistent/ckpt", "-o", "/tmp/never-written"], "checkpoint directory does not exist"),
        (["export", str(DEMO_CHECKPOINT / "config.json"), "-o", "/tmp/never-written"],
         f"config.json: is a file; expected the checkpoint's directory (the one holding config.json and the "
         f"safetensors): {DEMO_CHECKPOINT}?"),
        (["export", "-o", "/tmp/never-written", "--compute", "float8"],  # click's usage errors too
         "Invalid value for '--compute': 'float8' is not one of 'auto', 'float32', 'float16'; `mla-deploy export "
         "--help` lists the options"),
        (["run"], "Missing argument 'EXPORT_DIR'"),
    ]
    for args, message in cases:
        result = runner.invoke(main, args)
        assert result.exit_code != 0, args
        errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], (args, result.output)
        assert "Traceback" not in result.output and result.output.strip().splitlines()[-1] == errors[0]
        assert "Usage:" not in result.output and "Try 'mla-deploy" not in result.output, (args, result.output)
    debug = runner.invoke(main, ["--debug", "run", "/nonexistent/export", "--prompt-ids", "1"])
    assert debug.exit_code != 0 and isinstance(debug.exception, ExportLoadError)


def test_cli_provider_fallback_is_one_warning_line(exported):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    result = CliRunner().invoke(
        main, ["run", str(exported(VARIANT)), "--prompt-ids", "5,6", "-n", "2", "--provider", "cuda", "--json"]
    )
    assert result.exit_code == 0, result.output
    warned = [line for line in result.output.splitlines() if "CUDAExecutionProvider" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: ") and "falling back to CPU" in warned[0]
    assert json.loads(result.output.strip().splitlines()[-1])["token_ids"]


def test_verify_on_cuda_without_cuda_refuses_rather_than_passing_on_the_cpu(exported):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("CUDA is available here")
    result = CliRunner().invoke(main, ["verify", str(exported(VARIANT)), "--provider", "cuda"])
    assert result.exit_code == 1 and "PASS" not in result.output, result.output
    assert result.stderr.startswith("error: provider 'cuda' (CUDAExecutionProvider) is not available")
    assert "never falling back to the CPU" in result.stderr and len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize("graphs", [("prefill", "decode"), ("decode",)])
def test_timings_count_every_step_on_a_known_clock(exported, graphs, monkeypatch):
    """prefill_ms, decode_ms and decode tokens/s from the Generator's own clock reads: with a clock that advances
    exactly 10 ms per read, each prefill (through either graph) and decode step measures 10 ms. The clock starts
    far from 0, so a sum where a difference belongs is not hidden by a first reading of 0."""
    from mla_deploy.runtime import generator as generator_module

    model = ExportedModel(exported(VARIANT), graphs=graphs)
    ticks = iter(range(10**5, 10**6, 10))
    monkeypatch.setattr(generator_module.time, "perf_counter", lambda: next(ticks) / 1e3)
    result = Generator(model, stop_token_ids=(), chunk_size=64).generate([[5, 6, 7], [8, 9]], max_new_tokens=5)
    steps = 4  # the first token comes from the prefill's logits
    assert result.prefill_ms == pytest.approx(10.0) and result.decode_ms == pytest.approx(10.0 * steps)
    assert result.decode_tokens == 2 * steps and result.decode_tokens_per_s == pytest.approx(
        2 * steps / (10.0 * steps / 1e3)
    )


def test_cache_buffers_grow_in_blocks_and_refuse_beyond_the_export(model):
    from mla_deploy.runtime.cache import BLOCK, CacheBuffers

    caches = CacheBuffers(model.config, 2, 5, 3 * BLOCK, "cpu")
    assert caches.capacity == BLOCK  # rounded up to a block
    latent = caches.arrays[io_spec.past_latent(0)]
    assert (
        caches.ensure(BLOCK) is False and caches.arrays[io_spec.past_latent(0)] is latent
    )  # enough: nothing reallocated
    latent[:, :5] = 7.0
    assert caches.ensure(BLOCK + 1) is True and caches.capacity == 2 * BLOCK  # one more block, contents kept
    assert (caches.arrays[io_spec.past_latent(0)][:, :5] == 7.0).all()
    assert caches.ensure(3 * BLOCK) is True and caches.capacity == 3 * BLOCK
    with pytest.raises(
        InputError, match=f"sequence needs {3 * BLOCK + 1} cache slots, the export's maximum length is {3 * BLOCK}"
    ):
        caches.ensure(3 * BLOCK + 1)


@pytest.mark.parametrize("resident", [False, True], ids=["host", "resident"])
def test_clearing_a_row_zeroes_it_alone(model, resident):
    """What a failed request's row leaves: zeros in that row of every cache, the other rows as they were; resident
    caches (onnxruntime's own buffers, here on the CPU) are replaced, which the caller must bind again."""
    from mla_deploy.runtime.cache import CacheBuffers
    from mla_deploy.runtime.dtypes import to_device

    caches = CacheBuffers(model.config, 3, 5, 512, "cpu", resident=resident)
    for t in caches.tensors:
        filled = np.full(caches.host(t.past).shape, np.nan, np.float32).astype(caches.host(t.past).dtype)
        if resident:
            caches.values[t.past] = to_device(filled, t.dtype, "cpu")
        else:
            caches.arrays[t.past][:] = filled
    assert caches.clear_row(1) is resident
    for t in caches.tensors:
        host = caches.host(t.past).astype(np.float32)
        assert (host[1] == 0).all() and np.isnan(host[[0, 2]]).all(), t.past


def test_decode_binding_is_reused_until_the_cache_grows(model):
    gen = Generator(model, stop_token_ids=())
    state = gen.new_state([np.array([5, 6, 7])])
    gen.prefill(state, [[5, 6, 7]])
    gen.decode_step(state, np.array([8]))
    binding = state.decode_binding
    gen.decode_step(state, np.array([9]))
    assert state.decode_binding is binding  # the same capacity: bound once, not per step


def test_a_nan_distance_fails_verify_and_a_nan_loss_fails_eval():
    """max() passes over a NaN that is not first: a draft graph whose logits are NaN printed PASS; an export whose
    loss is NaN passed eval for being lossy; a quantized export whose deployed kernels give NaN passed verify."""
    from mla_deploy.evaluate import EvalReport
    from mla_deploy.verify import VerifyReport

    nan = float("nan")
    for report in (VerifyReport(1e-6, [1e-6, 1e-6], 1.0, 10.0, 1e-4, checks=[1e-6, nan]),
                   VerifyReport(1e-6, [nan], 1.0, 10.0, 1e-4), VerifyReport(nan, [1e-6], 1.0, 10.0, 1e-4)):
        assert np.isnan(report.worst) and not report.passed
    assert VerifyReport(1e-6, [1e-6], 1.0, 10.0, 1e-4, checks=[2e-6]).passed
    # a quantized export's deployed run: its drift is reported, not held to the tolerance, but NaN is no rounding
    assert VerifyReport(1e-6, [1e-6], 1.0, 10.0, 1e-4, deployed_drift=0.5).passed
    for drift in (nan, float("inf")):
        assert not VerifyReport(1e-6, [1e-6], 1.0, 10.0, 1e-4, deployed_drift=drift).passed
    lossy = {"quantization": {"bits": 4}}
    assert not EvalReport(10, 1, nan, 3.1, 0.0, **lossy).passed and not EvalReport(10, 1, nan, 3.1, 0.0).passed
    assert EvalReport(10, 1, 3.2, 3.1, 0.9, **lossy).passed and not EvalReport(10, 1, 3.2, 3.1, 0.9).passed


def test_the_api_takes_numpy_numbers_and_names_what_it_cannot_run(model):
    """numpy integers and floats are numbers to the API (booleans are not); a logit_bias id past the vocabulary, a
    graph the export lacks or a Generator without the decode graph is an InputError naming it, before anything
    runs."""
    params = SamplingParams(temperature=np.float32(0.8), top_k=np.int64(5), top_p=np.float32(0.9), seed=np.int64(1),
                            logit_bias=((np.int64(5), 10.0),))
    plain = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=1, logit_bias=((5, 10.0),))
    got = Generator(model, params, chunk_size=np.int64(2)).generate([[5, 6]], 4).token_ids
    assert got == Generator(model, plain, chunk_size=2).generate([[5, 6]], 4).token_ids
    for bad, message in ((dict(temperature=True), "temperature=True"), (dict(seed=True), "seed=True"),
                         (dict(top_p=True), "top_p=True")):
        with pytest.raises(InputError, match=message):
            SamplingParams(**bad).validate()
    vocab = model.config.vocab_size
    with pytest.raises(InputError, match=rf"logit_bias: token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
        Generator(model, SamplingParams(logit_bias=((vocab, 1.0),)))
    with pytest.raises(InputError, match=r"graphs='decode': expected a tuple of this export's graphs"):
        ExportedModel(model.directory, graphs="decode")
    with pytest.raises(InputError, match=r"graphs=\('foo',\)"):
        ExportedModel(model.directory, graphs=("foo",))
    prefill_only = Generator(ExportedModel(model.directory, graphs=("prefill",)))
    assert len(prefill_only.generate([[5, 6]], 1).token_ids[0]) == 1  # the first token is the prefill's
    with pytest.raises(InputError, match="max_new_tokens=3: the tokens after the first come from the decode graph"):
        prefill_only.generate([[5, 6]], 3)
