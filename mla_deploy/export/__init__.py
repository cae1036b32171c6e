"""Checkpoint -> ONNX graphs (needs the `export` extra: onnx, onnxscript; torch for verification).

The weight surgery (`absorb`) is numpy alone and imports without the extra: `inspect` and the benchmarks
use its byte counts; the exporter itself is imported on first use.
"""

from .absorb import AbsorbMode

__all__ = ["AbsorbMode", "ExportOptions", "ExportResult", "export"]


def __getattr__(name: str):
    if name in ("ExportOptions", "ExportResult", "export"):
        from . import exporter

        return getattr(exporter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
