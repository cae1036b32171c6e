"""The instruction-set levels of mla_deploy's kernels (mla_deploy/kernels/dispatch.h), which tests force one at a time
through MLA_DEPLOY_ISA (read as onnxruntime creates a kernel): which of them this CPU runs, from the cpuid flags that
dispatch.c reads, as /proc/cpuinfo names them."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

LEVELS = ("scalar", "avx2", "avx512")  # MLA_DEPLOY_ISA's values, each level including the ones before it
NEEDS = {"avx2": {"avx2", "fma", "f16c"}, "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}}


@functools.cache
def cpu_level() -> str:
    """The best level this CPU runs ("scalar" where /proc/cpuinfo cannot say)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set()
    if cpuinfo.exists():
        line = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "flags:")
        flags = set(line.split(":", 1)[1].split())
    if not NEEDS["avx2"] <= flags:
        return "scalar"
    return "avx512" if NEEDS["avx512"] <= flags else "avx2"


def params() -> list:
    """One pytest param per level, skipped with its reason where this CPU lacks it."""
    return [pytest.param(level, id=level, marks=pytest.mark.skipif(
        LEVELS.index(level) > LEVELS.index(cpu_level()),
        reason=f"this CPU has no {level} path (it lacks {' '.join(sorted(NEEDS.get(level, ())))})"))
        for level in LEVELS]
