"""What onnxruntime runs of an export's graph: the op types of the graph it optimized for a session with the
runtime's options (kernel library registered or not), so tests see which custom-op nodes it kept and which it inlined
from their function bodies."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort

from mla_deploy.runtime import ExportedModel


def optimized_op_types(model: ExportedModel, kind: str, directory: Path) -> set[str]:
    """The op types of `kind`'s graph as onnxruntime optimized it for `model`'s session, written under `directory`."""
    so = model.session_options(kind)
    so.optimized_model_filepath = str(directory / f"{kind}.optimized.onnx")
    ort.InferenceSession(str(model.directory / model.manifest["graphs"][kind]["file"]), so, providers=model.providers)
    optimized = onnx.load(so.optimized_model_filepath, load_external_data=False)
    return {node.op_type for node in optimized.graph.node}
