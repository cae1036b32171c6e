"""Checkpoint -> ONNX graphs (needs the `export` extra: onnx; torch for verification)."""

from .absorb import AbsorbMode
from .exporter import ExportOptions, ExportResult, export

__all__ = ["AbsorbMode", "ExportOptions", "ExportResult", "export"]
