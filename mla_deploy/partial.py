"""Directories that appear whole or not at all: a build (an export, a preset's checkpoint) writes into a hidden
partial directory beside its destination, `.NAME.partial-HOST-PID`, and renames it into place when complete; a build
that fails or is interrupted removes it. A process killed outright (SIGKILL, the kernel's OOM killer) cannot, so
the next build of the same destination removes what such a process left: the partials, and the `.NAME.old-HOST-PID`
an export swapped out with --force, of processes on this host that no longer run. A process still running, or one
on another host sharing the filesystem, keeps its own."""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from .errors import MLADeployError

KINDS = ("partial", "old")


def partial_directory(out: Path, note: Callable[[str], None] | None = None,
                      error: type[MLADeployError] = MLADeployError) -> Path:
    """A fresh, empty partial directory for building `out` (stale leftovers of `out` removed first, each named to
    `note`); `error` (the caller's kind) where it cannot be created."""
    for stale in stale_leftovers(out):
        size = _size(stale)
        shutil.rmtree(stale, ignore_errors=True)
        if note is not None:
            note(f"removed {stale.name} ({_human(size)}), left beside {out.name} by a process that no longer runs")
    tmp = scratch_path(out, "partial")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise error(f"{out}: cannot be created ({e.strerror or e}); choose another output path") from None
    return tmp


def destination(out: str | Path) -> Path:
    """A build's destination as given, or absolute where its last part names no directory of its own ("." or "..",
    whose hidden siblings would land inside it): the build is renamed into place from beside it."""
    out = Path(out)
    return Path(os.path.abspath(out)) if out.name in ("", "..") else out


def empty_directory(path: Path) -> bool:
    """A directory (not a link to one) with nothing in it, as `mktemp -d` makes one: a build may take its place."""
    return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None


def move_into_place(tmp: Path, out: Path) -> None:
    """Rename the complete build `tmp` to `out`. An empty directory there is taken; an earlier directory (one the
    caller may replace) is swapped out first and removed after; where the new one cannot take its place (an error,
    a signal between the two renames) the earlier one is put back, so a failed replacement leaves what was there."""
    if empty_directory(out):
        out.rmdir()
    if not out.exists():
        tmp.rename(out)
        return
    old = scratch_path(out, "old")
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists: where a directory created at `path` would go."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable_parent(out: Path) -> str | None:
    """Why `out` cannot be created, judged by its nearest existing ancestor (None: it can, as far as that shows)."""
    ancestor = nearest_existing(out.absolute().parent)
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable"
    return None


def unreplaceable(out: Path) -> str | None:
    """Why the directory at `out` cannot be replaced by a rename in its parent (None: it can, as far as that shows)."""
    parent = out.absolute().parent
    return None if os.access(parent, os.W_OK | os.X_OK) else f"{parent} is not writable"


def scratch_path(out: Path, kind: str) -> Path:
    """This process's hidden sibling of `out` of one kind (`partial`: being built; `old`: being replaced)."""
    return out.parent / f".{out.name}.{kind}-{_host()}-{os.getpid()}"


def stale_leftovers(out: Path) -> list[Path]:
    """The hidden siblings of `out` left by processes of this host that no longer run. A name without a host (as
    older versions wrote them) counts as this host's."""
    if not out.parent.is_dir():
        return []
    pattern = re.compile(rf"\.{re.escape(out.name)}\.(?:{'|'.join(KINDS)})-(?:(?P<host>.+)-)?(?P<pid>\d+)")
    found = []
    for p in out.parent.iterdir():
        m = pattern.fullmatch(p.name)
        if not m or not p.is_dir() or p.is_symlink():
            continue
        if m["host"] not in (None, _host()) or _running(int(m["pid"])):
            continue
        found.append(p)
    return sorted(found)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or a number no process has): not ours to judge
    return True


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and not f.is_symlink())


def _human(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
