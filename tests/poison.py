"""A copy of an export whose weights make some logits NaN, its manifest's digests updated to match (an export
written so, not a damaged file): for the runtime's handling of a model whose output cannot be sampled."""

import json
import shutil
from pathlib import Path

import numpy as np
import onnx

from mla_deploy.integrity import block_digests


def poisoned_copy(export_dir: Path, out: Path, initializer: str, element: int) -> Path:
    """`export_dir` copied to `out` with float32 element `element` (flat index) of `initializer` set to NaN."""
    shutil.copytree(export_dir, out)
    return poison(out, initializer, element)


def poison(export_dir: Path, initializer: str, element: int) -> Path:
    """Float32 element `element` (flat index) of `export_dir`'s `initializer` set to NaN in place, the manifest's
    digests updated to match."""
    graph = onnx.load(export_dir / "decode.onnx", load_external_data=False).graph
    where, = [{e.key: e.value for e in t.external_data} for t in graph.initializer if t.name == initializer]
    with open(export_dir / where["location"], "r+b") as f:
        f.seek(int(where["offset"]) + 4 * element)
        f.write(np.float32(np.nan).tobytes())
    manifest = json.loads((export_dir / "manifest.json").read_text())
    manifest["weights"]["block_digests"] = block_digests(export_dir / where["location"])
    (export_dir / "manifest.json").write_text(json.dumps(manifest))
    return export_dir
