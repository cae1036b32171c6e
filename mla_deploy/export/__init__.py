"""Checkpoint -> ONNX graphs (needs the `export` extra: onnx, onnxscript; torch for verification).

The weight surgery (`absorb`) and the plan (`plan`: options and the rules that resolve them) are numpy alone and
import without the extra: `inspect` and the benchmarks use them; the exporter itself is imported on first use.
"""

from .absorb import AbsorbMode

__all__ = ["AbsorbMode", "ExportOptions", "ExportPlan", "ExportResult", "export"]


def __getattr__(name: str):
    if name in ("ExportOptions", "ExportPlan"):
        from . import plan

        return getattr(plan, name)
    if name in ("ExportResult", "export"):
        from . import exporter

        return getattr(exporter, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
