"""What a new user meets first: damaged weights caught, missing extras named, options checked before any
output, progress from long commands, the benchmark's disk use said before it writes."""

import json
import random
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from mla_deploy import errors, integrity
from mla_deploy.cli import main
from mla_deploy.errors import ExportLoadError
from mla_deploy.export import export
from mla_deploy.manifest import check_export
from mla_deploy.presets import DEMO_CHECKPOINT
from mla_deploy.runtime import ExportedModel, RuntimeOptions


@pytest.fixture(scope="module")
def demo_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("first-hour") / "demo"
    export(DEMO_CHECKPOINT, out)
    return out


def flip_bytes(path, offset: int, n: int = 8) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        data = bytearray(f.read(n))
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


@pytest.fixture
def damaged(demo_export, tmp_path):
    """The demo export with 8 bytes flipped in the middle of weights.bin (same size, same graphs)."""
    d = tmp_path / "damaged"
    shutil.copytree(demo_export, d)
    flip_bytes(d / "weights.bin", (d / "weights.bin").stat().st_size // 2)
    return d


# ---- weights integrity ----
def test_flipped_weight_bytes_are_refused_at_load_naming_the_block(damaged):
    size = (damaged / "weights.bin").stat().st_size
    assert size <= integrity.FULL_AT_LOAD_BYTES  # a small export is checked whole at every load
    block = size // 2 // integrity.BLOCK_BYTES
    with pytest.raises(ExportLoadError, match=rf"weights.bin: corrupted: block {block} \(bytes {block * 2**20}-"):
        ExportedModel(damaged)


def test_run_and_check_exit_1_on_flipped_weights(damaged):
    runner = CliRunner()
    run = runner.invoke(main, ["run", str(damaged), "--prompt", "def f(", "-n", "4"])
    assert run.exit_code == 1 and run.stdout == "" and "corrupted: block" in run.stderr
    check = runner.invoke(main, ["check", str(damaged)])
    assert check.exit_code == 1 and "corrupted: block" in check.stderr
    flip_bytes(damaged / "weights.bin", 5)  # a second damaged block, before the first: both named, in file order
    block = (damaged / "weights.bin").stat().st_size // 2 // integrity.BLOCK_BYTES
    check = runner.invoke(main, ["check", str(damaged)])
    assert check.exit_code == 1, check.output
    assert f"corrupted: 2 blocks differ from the manifest's digests: 0 (bytes 0-1048575), {block} (bytes " \
           f"{block << 20}-" in check.stderr, check.stderr


def test_check_reads_every_block_of_an_intact_export(demo_export):
    result = CliRunner().invoke(main, ["check", str(demo_export)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((demo_export / "manifest.json").read_text())
    blocks = -(-manifest["weights"]["bytes"] // integrity.BLOCK_BYTES)
    assert len(manifest["weights"]["block_digests"]) == blocks and check_export(demo_export)["blocks"] == blocks
    assert f"graphs and {blocks} weight blocks" in result.stdout


def test_a_tokenizer_file_missing_from_an_export_is_named_by_check_and_at_load(demo_export, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(demo_export, copy)
    (copy / "tokenizer.json").unlink()
    check = CliRunner().invoke(main, ["check", str(copy)])
    assert check.exit_code == 1 and "tokenizer.json: missing (the manifest lists it" in check.stderr, check.output
    with pytest.raises(ExportLoadError, match="tokenizer.json: missing"):
        ExportedModel(copy)


def small_blocks(path, monkeypatch, block_bytes=32 * 1024):
    """Re-describe a weights file with 32 KiB blocks and no whole-file check, so it looks 'large'."""
    monkeypatch.setattr(integrity, "BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(integrity, "FULL_AT_LOAD_BYTES", 0)
    return {"bytes": path.stat().st_size, "block_bytes": block_bytes, "digest": integrity.DIGEST,
            "block_digests": integrity.block_digests(path)}


def test_a_large_file_is_sampled_at_load_and_read_whole_when_asked(demo_export, tmp_path, monkeypatch):
    weights = tmp_path / "weights.bin"
    shutil.copyfile(demo_export / "weights.bin", weights)
    entry = small_blocks(weights, monkeypatch)
    n = len(entry["block_digests"])
    assert n > 10 * integrity.SAMPLED_BLOCKS
    assert integrity.check_weights(weights, entry, "sampled", random.Random(0)) == integrity.SAMPLED_BLOCKS + 2
    assert integrity.check_weights(weights, entry, "full") == n
    flip_bytes(
        weights, entry["block_bytes"] * (n // 2) + 5
    )  # one damaged block: found by the full check, by some loads
    with pytest.raises(ExportLoadError, match=f"block {n // 2} "):
        integrity.check_weights(weights, entry, "full")
    caught = 0
    for seed in range(200):
        try:
            integrity.check_weights(weights, entry, "sampled", random.Random(seed))
        except ExportLoadError:
            caught += 1
    expected = 200 * integrity.SAMPLED_BLOCKS / (n - 2)
    assert 0.3 * expected < caught < 3 * expected  # random blocks each load, not always the same ones


def test_full_check_option_reaches_the_load(damaged, monkeypatch):
    monkeypatch.setattr(integrity, "FULL_AT_LOAD_BYTES", 0)
    monkeypatch.setattr(integrity, "SAMPLED_BLOCKS", 0)  # a sampled load now reads only the first and last block
    ExportedModel(damaged)  # the damage in the middle goes unseen by the sample...
    with pytest.raises(ExportLoadError, match="corrupted"):
        ExportedModel(damaged, RuntimeOptions(check_weights="full"))  # ...not by the full check
    result = CliRunner().invoke(main, ["run", str(damaged), "--check-weights", "--prompt-ids", "5", "-n", "2"])
    assert result.exit_code == 1 and "corrupted" in result.stderr


def test_manifest_without_digests_asks_for_a_re_export(demo_export, tmp_path):
    d = tmp_path / "old"
    shutil.copytree(demo_export, d)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["manifest_version"] = 1
    (d / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportLoadError, match="has no weight checksums; re-export"):
        ExportedModel(d)


# ---- missing extras ----
BLOCKED_RUN = ("import sys\n"
               "for name in sys.argv[1].split(','): sys.modules[name] = None  # as if not installed\n"
               "from mla_deploy.cli import main\n"
               "main(sys.argv[2:], prog_name='mla-deploy')\n")


@pytest.mark.parametrize("blocked, args, extra", [
    ("onnx", ["export", "-o", "{tmp}/out"], "export"),
    ("torch", ["export", "-o", "{tmp}/out"], "export"),
    ("torch", ["verify", "{export}"], "export"),
    ("torch", ["eval", "{export}", "--text", "{text}"], "export"),
    ("psutil", ["bench", "--quick", "--workdir", "{tmp}/work"], "bench"),
    ("matplotlib,psutil", ["bench", "--quick", "--workdir", "{tmp}/work"], "bench"),
    ("fastapi", ["serve", "{export}", "--port", "0"], "serve"),
    ("uvicorn", ["serve", "{export}", "--port", "0"], "serve"),
    ("ray", ["serve", "{export}", "--ray-replicas", "2"], "ray"),
])
def test_a_missing_extra_is_one_line_naming_the_install(demo_export, tmp_path, blocked, args, extra):
    text = DEMO_CHECKPOINT / "heldout.txt"
    args = [a.format(tmp=tmp_path, export=demo_export, text=text) for a in args]
    done = subprocess.run([sys.executable, "-c", BLOCKED_RUN, blocked, *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: `mla-deploy {args[0]}` needs the '{extra}' extra"), lines
    assert lines[0].endswith(f": {errors.install_command(extra)}")  # this checkout's: pip install -e '...[extra]'
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


def test_ctrl_c_while_the_command_line_loads_is_one_line():
    """An interrupt during the first half second (the command line's imports) ends `mla-deploy` with "interrupted"
    and 130, as one later does, not the import's traceback; `python -m mla_deploy` is the same command."""
    code = ("import builtins\n"
            "real = builtins.__import__\n"
            "def interrupted(name, *args, **kwargs):\n"
            "    if name == 'cli' or name.endswith('.cli'):\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = interrupted\n"
            "from mla_deploy.__main__ import main\n"
            "main()\n")
    done = subprocess.run([sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr, done.stdout) == (130, "interrupted\n", "")
    helped = subprocess.run([sys.executable, "-m", "mla_deploy", "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "Usage: python -m mla_deploy [OPTIONS] COMMAND" in helped.stdout


def test_an_unknown_missing_module_stays_an_internal_error(monkeypatch):
    assert errors.missing_extra("numpy") is None and errors.missing_extra("torch.nn") is not None


def test_the_install_command_adds_the_extra_where_the_install_came_from():
    """pip's record of the installation (PEP 610): a clone's directory (editable or not), a wheel, a git URL, an
    index. mla-deploy is on no index: its name alone is no command for a user who installed from a clone."""
    assert errors.install_command("export", {"url": "file:///home/u/my%20clone", "dir_info": {"editable": True}}) \
        == "pip install -e '/home/u/my clone[export]'"
    assert errors.install_command("serve", {"url": "file:///src/mla-deploy", "dir_info": {}}) \
        == "pip install '/src/mla-deploy[serve]'"
    assert errors.install_command("bench", {"url": "file:///tmp/mla_deploy-0.1.0-cp311-linux_x86_64.whl",
                                            "archive_info": {}}) \
        == "pip install '/tmp/mla_deploy-0.1.0-cp311-linux_x86_64.whl[bench]'"
    git = {"url": "https://example.com/o/mla-deploy.git", "vcs_info": {"vcs": "git", "commit_id": "0" * 40}}
    assert errors.install_command("ray", git) == "pip install 'mla-deploy[ray] @ git+https://example.com/o/mla-deploy.git'"
    assert errors.install_command("ray", {**git, "vcs_info": {**git["vcs_info"], "requested_revision": "v1"}}) \
        == "pip install 'mla-deploy[ray] @ git+https://example.com/o/mla-deploy.git@v1'"
    assert errors.install_command("export", {}) == "pip install 'mla-deploy[export]'"


# ---- option errors before output ----
@pytest.mark.parametrize("args, message", [
    (["-n", "-5"], "'-n' / '--max-new-tokens': -5 is not in the range x>=1"),
    (["--temperature", "-1"], "'--temperature': -1.0 is not in the range x>=0"),
    (["--temperature", "nan"], "temperature=nan: must be a finite number >= 0"),
    (["-n", "5000"], "exceeds the export's maximum length 1024"),
])
def test_run_checks_options_before_printing_the_prompt(demo_export, args, message):
    result = CliRunner().invoke(main, ["run", str(demo_export), "--prompt", "class Stack:", *args])
    assert result.exit_code in (1, 2) and result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and message in result.stderr


def test_run_on_a_file_says_it_is_a_file():
    result = CliRunner().invoke(main, ["run", str(DEMO_CHECKPOINT / "README.md"), "--prompt", "x"])
    assert result.exit_code == 1
    assert "README.md: is a file; expected an export directory" in result.stderr


def test_run_threads_option_reaches_onnxruntime(demo_export):
    result = CliRunner().invoke(main, ["run", str(demo_export), "--prompt-ids", "5,6", "-n", "3", "--threads", "1",
                                       "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["token_ids"]) == 3


def test_session_config_options_reach_the_sessions_of_run_and_serve(demo_export, monkeypatch):
    from mla_deploy import runtime
    from mla_deploy.serve import server

    key = "session.inter_op.allow_spinning"  # set_denormal_as_zero would set flush-to-zero on this process's thread
    seen = []

    class Recording(runtime.ExportedModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(
                {kind: s.get_session_options().get_session_config_entry(key) for kind, s in self.sessions.items()}
            )

    monkeypatch.setattr(runtime, "ExportedModel", Recording)
    result = CliRunner().invoke(main, ["run", str(demo_export), "--prompt-ids", "5,6", "-n", "2", "--json",
                                       "--session-config", f" {key} = 1"])
    assert result.exit_code == 0, result.output
    assert seen == [{"prefill": "1", "decode": "1"}]
    served = []
    monkeypatch.setattr(
        server, "build_service", lambda *args: served.append(args[5]) or SimpleNamespace(model_name="m")
    )
    monkeypatch.setattr(server, "serve", lambda *args: None)
    result = CliRunner().invoke(main, ["serve", str(demo_export), "--port", "0", "--session-config", f"{key}=1"])
    assert result.exit_code == 0, result.output
    assert [options.session_config for options in served] == [((key, "1"),)]
    for bad in (key, f"{key}=", "=1"):
        for command in ("run", "serve"):
            result = CliRunner().invoke(main, [command, str(demo_export), "--session-config", bad])
            assert result.exit_code == 2 and f"{bad!r}: expected KEY=VALUE" in result.stderr


def test_serve_on_a_port_in_use_says_so_in_one_line_before_loading(demo_export, monkeypatch):
    import socket

    from mla_deploy.serve import server

    loaded = []
    monkeypatch.setattr(server, "build_service", lambda *args: loaded.append(args))
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        result = CliRunner().invoke(main, ["serve", str(demo_export), "--port", str(port)])
    finally:
        taken.close()
    assert result.exit_code == 1 and loaded == [], result.output
    assert result.stderr == f"error: 127.0.0.1:{port}: cannot listen there (in use by another process); choose " \
                            "another --port or --host\n", result.stderr
    result = CliRunner().invoke(main, ["serve", str(demo_export), "--host", "no.such.host.invalid"])
    assert result.exit_code == 1 and "--host no.such.host.invalid: not an address of this machine" in result.stderr


def test_help_documents_every_option():
    runner = CliRunner()
    export_help = runner.invoke(main, ["export", "--help"]).stdout
    assert "fewer weight bytes" in export_help and "Teacher-forced decode steps" in export_help
    run_help = runner.invoke(main, ["run", "--help"]).stdout
    assert "0 is off" in run_help and "--threads" in run_help and "--check-weights" in run_help
    assert "Teacher-forced" in runner.invoke(main, ["verify", "--help"]).stdout


# ---- progress and disk ----
def test_eval_reports_progress_on_stderr(demo_export, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text((DEMO_CHECKPOINT / "heldout.txt").read_text()[:6000])
    result = CliRunner().invoke(main, ["eval", str(demo_export), "--text", str(text), "--window", "32"])
    assert result.exit_code == 0, result.output
    progress = [line for line in result.stderr.splitlines() if "windows" in line]
    assert any("onnx export : " in line for line in progress) and any("torch source: " in line for line in progress)
    last = [line for line in progress if "torch source" in line][-1]
    done, total = last.split(": ")[1].split(" windows")[0].split("/")
    assert done == total and int(total) > 8 and "tokens/s" in last
    assert "loss" in result.stdout and "tokens/s" not in result.stdout


def test_eval_names_a_text_file_it_cannot_score(demo_export, tmp_path):
    cases = {"latin1.txt": ("caf\xe9 au lait".encode("latin-1"), "not UTF-8 text (byte 0xe9 at offset 3)"),
             "empty.txt": (b" \n", "empty; eval needs text to score")}
    for name, (content, said) in cases.items():
        (tmp_path / name).write_bytes(content)
        result = CliRunner().invoke(main, ["eval", str(demo_export), "--text", str(tmp_path / name)])
        assert result.exit_code == 1 and result.stderr.strip() == f"error: {tmp_path / name}: {said}" + (
            "; eval scores text files" if name == "latin1.txt" else ""), result.output


def test_eval_reads_a_leading_byte_order_mark_as_no_text(demo_export, tmp_path):
    from mla_deploy.evaluate import evaluate

    text = (DEMO_CHECKPOINT / "heldout.txt").read_text()[:1500]
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text(text, encoding="utf-8")
    marked.write_text(text, encoding="utf-8-sig")
    assert marked.read_bytes()[:3] == b"\xef\xbb\xbf"
    a, b = evaluate(demo_export, plain, window=64), evaluate(demo_export, marked, window=64)
    assert (a.tokens, a.export_loss) == (b.tokens, b.export_loss)


def test_eval_scores_token_ids_as_it_scores_their_text(demo_export, tmp_path):
    from mla_deploy.runtime import Tokenizer

    text = tmp_path / "text.txt"
    text.write_text((DEMO_CHECKPOINT / "heldout.txt").read_text()[:1500])
    ids = Tokenizer.from_export(demo_export, ExportedModel(demo_export).manifest).encode(text.read_text())
    id_file = tmp_path / "ids.txt"  # commas, spaces and lines alike separate ids
    id_file.write_text(",".join(map(str, ids[:10])) + "\n" + " ".join(map(str, ids[10:])) + "\n")
    by_text = CliRunner().invoke(main, ["eval", str(demo_export), "--text", str(text), "--window", "64"])
    by_ids = CliRunner().invoke(main, ["eval", str(demo_export), "--ids", str(id_file), "--window", "64"])
    assert by_text.exit_code == by_ids.exit_code == 0, by_ids.output
    assert by_ids.stdout == by_text.stdout and f"scored {len(ids) - 1} tokens" in by_ids.stdout
    as_json = CliRunner().invoke(main, ["eval", str(demo_export), "--ids", str(id_file), "--window", "64", "--json"])
    assert as_json.exit_code == 0, as_json.output
    report = json.loads(as_json.stdout)  # one object, the figures the text lines print
    assert (report["tokens"], report["window"], report["passed"], report["dtype"]) == (len(ids) - 1, 64, True,
                                                                                        "float32")
    assert f"loss {report['export']['loss']:.4f}  perplexity {report['export']['perplexity']:.3f}" in by_ids.stdout
    assert abs(report["loss_difference"]) <= report["tolerance"] and report["quantization"] is None


def test_eval_names_a_token_id_file_it_cannot_score(demo_export, tmp_path):
    vocab = ExportedModel(demo_export).config.vocab_size
    cases = {"word.txt": ("1 2, x 4", "token 3 is 'x', not an integer"),
             "vocab.txt": (f"1 {vocab}", f"token 2 is {vocab}, outside the vocabulary [0, {vocab})"),
             "negative.txt": ("5,-1", "token 2 is -1, outside the vocabulary"),
             "empty.txt": (" ,\n", "empty; eval needs token ids to score")}
    for name, (content, said) in cases.items():
        (tmp_path / name).write_text(content)
        result = CliRunner().invoke(main, ["eval", str(demo_export), "--ids", str(tmp_path / name)])
        assert result.exit_code == 1 and result.stderr.startswith(f"error: {tmp_path / name}: {said}"), result.output
    for args in ([], ["--ids", str(tmp_path / "word.txt"), "--text", str(tmp_path / "word.txt")]):
        result = CliRunner().invoke(main, ["eval", str(demo_export), *args])
        assert result.exit_code == 2 and "give one of --text FILE or --ids FILE" in result.output


def test_bench_says_its_disk_use_and_refuses_without_room(tmp_path, monkeypatch):
    from mla_deploy.bench import run as bench_run

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(bench_run.shutil, "disk_usage", lambda p: usage._replace(free=10**9))
    result = CliRunner().invoke(main, ["bench", "--quick", "--workdir", str(tmp_path / "work"), "--out",
                                       str(tmp_path / "results")])
    assert result.exit_code == 1
    assert "GB to build in" in result.stderr and "(reused on later runs; 1.0 GB free)" in result.stderr
    assert "needs about" in result.stderr and "pass --workdir on a larger disk" in result.stderr
    assert [p.name for p in (tmp_path / "work").iterdir()] == [] and not (tmp_path / "results").exists()


def test_preset_help_names_every_preset():
    from mla_deploy.presets import preset_names

    shown = " ".join(CliRunner().invoke(main, ["preset", "--help"]).output.split())
    assert preset_names() and all(name in shown for name in preset_names()), shown


def test_preset_says_its_size_and_refuses_without_room(tmp_path, monkeypatch):
    from mla_deploy import presets
    from mla_deploy.presets import preset_config, random_checkpoint_bytes

    size = random_checkpoint_bytes(preset_config("v2lite", 1))
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(presets.shutil, "disk_usage", lambda p: usage._replace(free=size - 1))
    result = CliRunner().invoke(main, ["preset", "v2lite", "--layers", "1", "-o", str(tmp_path / "ckpt")])
    assert result.exit_code == 1 and list(tmp_path.iterdir()) == [], result.output
    assert result.stderr == (f"error: {tmp_path / 'ckpt'}: the checkpoint takes {size / 1e9:.2f} GB and "
                             f"{(size - 1) / 1e9:.2f} GB are free there; choose another output path (nothing was "
                             "written)\n")
    for option, value in (("--seed", "-1"), ("--layers", "0")):  # usage errors, before any writing
        result = CliRunner().invoke(main, ["preset", "tiny-v3", "-o", str(tmp_path / "bad"), option, value])
        assert result.exit_code == 2 and f"'{option}': {value} is not in the range" in result.stderr, result.output
        assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(presets.shutil, "disk_usage", lambda p: usage._replace(free=size))
    result = CliRunner().invoke(main, ["preset", "tiny-v3", "-o", str(tmp_path / "tiny")])
    tiny = random_checkpoint_bytes(preset_config("tiny-v3"))
    assert result.exit_code == 0 and result.stderr.startswith(f"writing {tiny / 1e9:.2f} GB (")
    assert sum(f.stat().st_size for f in (tmp_path / "tiny").glob("*.safetensors")) >= tiny


def test_bench_does_not_import_the_command_line():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, mla_deploy.bench.run; print('mla_deploy.cli' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "False"


def test_a_preset_whose_directory_cannot_be_replaced_is_refused_before_writing(tmp_path, monkeypatch):
    """The checkpoint takes an empty or earlier directory's place by a rename in its parent: a parent this process
    cannot write is said before a byte is written."""
    import os
    from pathlib import Path

    locked = tmp_path / "locked"
    (locked / "empty").mkdir(parents=True)
    access = os.access  # root writes anywhere: the parent's answer is set here
    monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and Path(path) != locked)
    result = CliRunner().invoke(main, ["preset", "tiny-v3", "-o", str(locked / "empty")])
    assert result.exit_code == 1 and f"{locked / 'empty'}: cannot be replaced ({locked} is not writable)" in \
        result.output, result.output
    assert sorted(p.name for p in locked.iterdir()) == ["empty"] and not any((locked / "empty").iterdir())


def test_a_preset_that_cannot_be_written_says_so_and_keeps_the_earlier_one(tmp_path):
    """A file-size limit (EFBIG, as a full disk gives ENOSPC) mid-write: one line naming the failure, no partial
    directory, and the earlier random checkpoint at -o untouched."""
    out = tmp_path / "ckpt"
    assert CliRunner().invoke(main, ["preset", "tiny-v3", "-o", str(out)]).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 2**20, 16 * 2**20))\n"
            "from mla_deploy.cli import main\n"
            f"main(['preset', 'v2lite-2L', '-o', {str(out)!r}])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"error: {out}: writing the checkpoint failed (File too large); "
                                                    "nothing was left behind, and an earlier checkpoint there is as "
                                                    "it was")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_killed_preset_leaves_no_partial_directory(tmp_path):
    """SIGTERM unwinds like Ctrl-C: the half-written checkpoint directory is removed, exit 130. Sent as soon as the
    partial directory exists, leaving the whole write as margin: two layers (~2 GB, ~13 s here). With one layer
    (~5 s) a loaded CI run once saw exit -2, the interrupt raised outside the command, as when it arrives after the
    write; the assertion prints the code, stderr and directory should it happen again. Waiting for the first shard
    to appear left under a second."""
    import signal
    import time

    out = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mla_deploy.cli", "preset", "v2lite", "--layers", "2", "-o", str(out)],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".ckpt.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list(tmp_path.glob(".ckpt.partial-*")), "the preset never started writing"
    proc.send_signal(signal.SIGTERM)
    code, stderr = proc.wait(timeout=60), proc.stderr.read()
    assert code == 130 and "interrupted" in stderr, (code, stderr[-2000:], sorted(p.name for p in tmp_path.iterdir()))
    assert list(tmp_path.iterdir()) == []


def test_preset_replaces_only_an_earlier_random_checkpoint(tmp_path):
    """-o over the user's own files is refused (nothing written, nothing deleted); over an earlier preset it is
    replaced; an empty directory is used."""
    cli = CliRunner()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    plain = tmp_path / "plain.txt"
    plain.write_text("keep me too")
    for out in (mine, plain):
        result = cli.invoke(main, ["preset", "tiny-v3", "-o", str(out)])
        assert result.exit_code == 1 and str(out) in result.output, result.output
    assert (mine / "notes.txt").read_text() == "keep me" and plain.read_text() == "keep me too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "plain.txt"]  # no partial directory left
    earlier = tmp_path / "earlier"
    assert cli.invoke(main, ["preset", "tiny-v3", "-o", str(earlier), "--seed", "1"]).exit_code == 0
    (earlier / "NOTES.md").write_text("mine")  # the user's, beside the random weights: replacing would delete it
    (earlier / "out").mkdir()
    kept = cli.invoke(main, ["preset", "tiny-v3", "-o", str(earlier), "--seed", "2"])
    assert kept.exit_code == 1 and "also holds what `mla-deploy preset` did not write (NOTES.md, out)" in kept.output
    assert (earlier / "NOTES.md").read_text() == "mine" and json.loads((earlier / "config.json").read_text())[
        "_random_weights"] == {"seed": 1}
    (earlier / "NOTES.md").unlink()
    (earlier / "out").rmdir()
    assert cli.invoke(main, ["preset", "tiny-v3", "-o", str(earlier), "--seed", "2"]).exit_code == 0
    assert json.loads((earlier / "config.json").read_text())["_random_weights"] == {"seed": 2}
    whole = (earlier / "model.safetensors").read_bytes()
    (earlier / "model.safetensors").write_bytes(whole[: len(whole) // 2])  # cut short, then gone: written again
    assert cli.invoke(main, ["preset", "tiny-v3", "-o", str(earlier), "--seed", "2"]).exit_code == 0
    assert (earlier / "model.safetensors").read_bytes() == whole
    (earlier / "model.safetensors").unlink()
    assert cli.invoke(main, ["preset", "tiny-v3", "-o", str(earlier), "--seed", "2"]).exit_code == 0
    assert (earlier / "model.safetensors").read_bytes() == whole
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (
        cli.invoke(main, ["preset", "tiny-v3", "-o", str(empty)]).exit_code == 0 and (empty / "config.json").is_file()
    )
