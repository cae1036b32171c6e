"""Map every page of weights.bin into this process up front, as llama.cpp does with MAP_POPULATE.

onnxruntime memory-maps each initializer's range of weights.bin on its own (one mapping per tensor and session,
listed in /proc/self/maps) and leaves the pages to be faulted in as a kernel first reads them. A decode step reads
only the experts its router picks, so for a model with many experts the first hundreds of steps keep taking page
faults on experts no step read before: a fresh full-size DeepSeek-V2-Lite session decoded at 18-23 tokens/s where
one whose weights a prefill had touched ran at 26-33 (docs/benchmarks.md). madvise(MADV_POPULATE_READ) (Linux
5.14) over each of those mappings maps their pages at load instead, reading from the page cache (or the disk) once:
the steps then run at their steady rate from the first.

Linux only; elsewhere, or on a kernel without MADV_POPULATE_READ, nothing is done.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

MADV_POPULATE_READ = 22  # linux/mman.h, 5.14


def mappings(path: Path, maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """(start, end) of every mapping of `path` in this process."""
    target = str(Path(path).resolve())
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    return out


def fits_in_memory(size: int, meminfo: str = "/proc/meminfo") -> bool:
    """Whether `size` bytes fit in the memory the kernel reports available (MemAvailable); False where unknown.
    Populating a file larger than that would push out the pages it just read."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return size <= int(line.split()[1]) * 1024
    except OSError:
        pass
    return False


def populate(path: Path, skip: frozenset[tuple[int, int]] = frozenset()) -> int:
    """Map every page of every mapping of `path` but those in `skip` (populated already) with madvise
    MADV_POPULATE_READ. Returns the bytes populated: 0 where the platform cannot (not Linux, an older kernel)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = 0
    for start, end in mappings(path):
        if (start, end) in skip:
            continue
        if libc.madvise(start, end - start, MADV_POPULATE_READ) != 0:
            return done  # EINVAL: a kernel without it; anything else leaves the rest to be faulted in as read
        done += end - start
    return done
