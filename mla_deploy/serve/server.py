"""Starting the server: load the export, start its Engine, run uvicorn on the app."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from ..errors import ExportLoadError
from ..manifest import is_staged, read_manifest
from ..runtime import ExportedModel, RuntimeOptions
from ..runtime.chain import StagedExport
from ..runtime.engine import Engine
from ..runtime.speculative import Speculation
from .app import Service, create_app


def build_service(export_dir: str | Path, max_batch: int = 16, max_queue: int = 256, api_key: str | None = None,
                  model_name: str | None = None, options: RuntimeOptions | None = None,
                  prefill_chunk: int = 256, speculation: Speculation | None = None, ray_address: str | None = None,
                  micro_batches: int | None = None) -> Service:
    """`speculation`: the engine's (runtime.speculative), which a request may opt out of. A staged export (export
    --stages N) loads as one Ray actor per stage (runtime.stages, the 'ray' extra; `ray_address`: the cluster to
    join, default a local Ray instance), `micro_batches` groups of rows in flight (default: one per stage)."""
    if is_staged(read_manifest(export_dir)):
        try:
            from ..runtime.stages import StagedModel
        except ImportError as e:
            raise ExportLoadError(f"{export_dir}: a staged export runs its stages on Ray, which is not installed "
                                  f"({e}): pip install 'mla-deploy[serve,ray]'") from None
        model = StagedModel(export_dir, options, address=ray_address)
    else:
        model = ExportedModel(export_dir, options)
    try:
        engine = Engine(model, max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                        speculation=speculation, micro_batches=micro_batches)
    except BaseException:
        _shutdown(model)
        raise
    return Service(engine, model_name or Path(export_dir).resolve().name, api_key)


def serve(service: Service, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    try:
        uvicorn.run(create_app(service), host=host, port=port, log_level=log_level, access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        service.engine.close()
        _shutdown(service.engine.model)


def _shutdown(model) -> None:
    """A staged export's Ray actors (and Ray, where the model started it); nothing for an ExportedModel."""
    if isinstance(model, StagedExport) and hasattr(model, "shutdown"):
        model.shutdown()
