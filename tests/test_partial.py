"""What a build killed outright leaves beside its destination, and the next build's removal of exactly that."""

import os
import signal
import subprocess
import sys
import time

from mla_deploy.partial import move_into_place, partial_directory, scratch_path, stale_leftovers
from tiny import VARIANTS


def gone_pid() -> int:
    """The pid of a process that has run and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def leftover(parent, name: str):
    d = parent / name
    d.mkdir()
    (d / "weights.bin").write_bytes(b"\0" * 1000)
    return d


def test_only_the_destinations_leftovers_of_gone_processes_of_this_host_are_stale(tmp_path):
    out, pid = tmp_path / "exp", gone_pid()
    host = scratch_path(out, "partial").name.split(".partial-")[1].rsplit("-", 1)[0]
    stale = [leftover(tmp_path, f".exp.partial-{pid}"),  # as older versions named it: no host
             leftover(tmp_path, f".exp.partial-{host}-{pid}"),
             leftover(tmp_path, f".exp.old-{host}-{pid}")]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kept = [leftover(tmp_path, f".exp.partial-{host}-{sleeper.pid}"),  # still running
                leftover(tmp_path, f".exp.partial-{host}-{os.getpid()}"),  # this process
                leftover(tmp_path, f".exp.partial-otherhost-{pid}"),  # another host's: its pids are not ours
                leftover(tmp_path, f".exp2.partial-{host}-{pid}"),  # another destination
                leftover(tmp_path, f".exp.partial-{host}-{pid}x"),  # not the pattern
                leftover(tmp_path, "exp.partial-1")]
        (tmp_path / f".exp.old-{pid}").write_text("a file, not a directory")
        assert stale_leftovers(out) == sorted(stale)
        notes = []
        tmp = partial_directory(out, notes.append)
        assert tmp == scratch_path(out, "partial") and tmp.is_dir() and not any(tmp.iterdir())
        assert all(not p.exists() for p in stale) and all(p.exists() for p in kept if p != tmp)
        assert len(notes) == 3 and all("no longer runs" in n and "exp" in n for n in notes), notes
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_missing_parent_has_no_leftovers(tmp_path):
    assert stale_leftovers(tmp_path / "nowhere" / "exp") == []


def test_a_preset_killed_outright_is_cleared_by_the_next_build(tmp_path):
    """SIGKILL leaves the partial checkpoint (no handler runs); building the same destination again removes it,
    says so, and completes. Two layers of v2lite (~2 GB) give the kill a whole write of margin."""
    out = tmp_path / "ckpt"
    def preset(layers: int) -> list[str]:
        return [sys.executable, "-m", "mla_deploy.cli", "preset", "v2lite", "--layers", str(layers), "-o", str(out)]

    proc = subprocess.Popen(preset(2), stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".ckpt.partial-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    left = list(tmp_path.glob(".ckpt.partial-*"))
    assert len(left) == 1 and not out.exists(), sorted(p.name for p in tmp_path.iterdir())
    done = subprocess.run(preset(1), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"removed {left[0].name}" in done.stderr and "no longer runs" in done.stderr, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_an_export_clears_what_a_killed_export_of_the_same_destination_left(checkpoint_dir, tmp_path):
    from mla_deploy.export import ExportOptions, export

    src, _ = checkpoint_dir(sorted(VARIANTS)[0])
    out = tmp_path / "exp"
    stale = leftover(tmp_path, f".exp.partial-{gone_pid()}")
    said = []
    export(src, out, ExportOptions(), progress=said.append)
    assert not stale.exists() and (out / "manifest.json").is_file()
    assert any(f"removed {stale.name}" in s for s in said), said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]


def test_an_output_under_a_file_is_refused_before_any_work(tmp_path):
    from click.testing import CliRunner

    from mla_deploy.cli import main

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    for args in (["export", "-o", str(a_file / "exp")], ["preset", "tiny-v3", "-o", str(a_file / "sub" / "ckpt")]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code != 0 and "internal error" not in result.output, result.output
        assert f"{a_file} is a file, not a directory" in result.output, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and a_file.read_text() == "mine"


def test_a_replacement_that_cannot_take_its_place_puts_the_earlier_one_back(tmp_path, monkeypatch):
    """The swap renames the earlier directory aside, then the new one in: where the second rename fails or a signal
    arrives between them, the earlier one is renamed back (not left hidden as `.out.old-...`, which the next build
    removes as a dead process's leftover); once the new one is in place the earlier one is removed."""
    import pathlib

    import pytest

    out, new = tmp_path / "out", tmp_path / ".out.partial"
    real = pathlib.Path.rename
    for failure in (KeyboardInterrupt(), OSError(28, "No space left on device")):
        out.mkdir(exist_ok=True)
        (out / "weights.bin").write_text("earlier")
        new.mkdir()
        (new / "weights.bin").write_text("new")

        def rename(self, target, failure=failure):
            if self == new:
                raise failure
            return real(self, target)

        monkeypatch.setattr(pathlib.Path, "rename", rename)
        with pytest.raises(type(failure)):
            move_into_place(new, out)
        monkeypatch.setattr(pathlib.Path, "rename", real)
        assert (out / "weights.bin").read_text() == "earlier" and not scratch_path(out, "old").exists()
        (new / "weights.bin").unlink()
        new.rmdir()
    new.mkdir()
    (new / "weights.bin").write_text("new")
    move_into_place(new, out)
    assert (out / "weights.bin").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
