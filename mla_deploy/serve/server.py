"""Starting the server: load the export, start its Engine, run uvicorn on the app."""

from __future__ import annotations

from pathlib import Path

import uvicorn

from ..runtime import ExportedModel, RuntimeOptions
from ..runtime.engine import Engine
from ..runtime.speculative import Speculation
from .app import Service, create_app


def build_service(export_dir: str | Path, max_batch: int = 16, max_queue: int = 256, api_key: str | None = None,
                  model_name: str | None = None, options: RuntimeOptions | None = None,
                  prefill_chunk: int = 256, speculation: Speculation | None = None) -> Service:
    """`speculation`: the engine's (runtime.speculative), which a request may opt out of."""
    model = ExportedModel(export_dir, options)
    engine = Engine(model, max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                    speculation=speculation)
    return Service(engine, model_name or Path(export_dir).resolve().name, api_key)


def serve(service: Service, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning") -> None:
    try:
        uvicorn.run(create_app(service), host=host, port=port, log_level=log_level, access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        service.engine.close()
