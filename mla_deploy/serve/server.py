"""Starting the server: load the export, start its Engine, run uvicorn on the app."""

from __future__ import annotations

import errno
import socket
import threading
from pathlib import Path

import uvicorn

from ..errors import ExportLoadError, ServeError, install_command
from ..manifest import is_staged, read_manifest, require_whole
from ..runtime import ExportedModel, RuntimeOptions
from ..runtime.chain import StagedExport
from ..runtime.chat import ChatTemplate
from ..runtime.engine import Engine
from ..runtime.speculative import Speculation
from .app import Service, create_app


def build_service(export_dir: str | Path, max_batch: int = 16, max_queue: int = 256, api_key: str | None = None,
                  model_name: str | None = None, options: RuntimeOptions | None = None,
                  prefill_chunk: int = 256, speculation: Speculation | None = None, ray_address: str | None = None,
                  micro_batches: int | None = None, prefix_caching: bool = True,
                  chat_template: str | Path | None = None, reasoning_parser: str | None = None,
                  cache_reuse: int = 0, allowed_origins: tuple[str, ...] = ()) -> Service:
    """`speculation`: the engine's (runtime.speculative), which a request may opt out of; `prefix_caching`,
    `cache_reuse`: the scheduler's (runtime.prefix); `chat_template`: a Jinja file in place of the export's
    template, read before the model loads; `reasoning_parser`: serve.reasoning's. A staged export (export --stages
    N) loads as one Ray actor per stage (runtime.stages, the 'ray' extra; `ray_address`: the cluster to join,
    default a local Ray instance), `micro_batches` groups of rows in flight (default: one per stage), every prompt
    prefilled whole. `allowed_origins`: the web origins whose pages may call the routes (CORS; "*": any)."""
    # a bad template is said before the weights load
    template = None if chat_template is None else ChatTemplate.from_export(export_dir, chat_template)
    manifest = read_manifest(export_dir)
    require_whole(export_dir, manifest, "serve")  # before any graph loads
    if is_staged(manifest):
        try:
            from ..runtime.stages import StagedModel
        except ImportError as e:
            raise ExportLoadError(f"{export_dir}: a staged export runs its stages on Ray, which is not installed "
                                  f"({e}): {install_command('serve,ray')}") from None
        model = StagedModel(export_dir, options, address=ray_address)
    else:
        model = ExportedModel(export_dir, options)
    try:
        engine = Engine(model, max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                        speculation=speculation, micro_batches=micro_batches, prefix_caching=prefix_caching,
                        cache_reuse=cache_reuse)
    except BaseException:
        _shutdown(model)
        raise
    try:
        return Service(engine, model_name or Path(export_dir).resolve().name, api_key, chat_template=template,
                       reasoning_parser=reasoning_parser, allowed_origins=allowed_origins)
    except BaseException:
        engine.close()
        _shutdown(model)
        raise


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening: taken first, so a port in use is said before the model loads (port
    0: one the system picks; getsockname() gives it)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ServeError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a restart reuses the port
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        what = "in use by another process" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise ServeError(f"{host}:{port}: cannot listen there ({what}); choose another --port or --host") from None
    sock.set_inheritable(True)
    return sock


GRACE_S = 5.0  # a shutdown gives running requests this long (uvicorn's graceful shutdown), less ANSWER_S
ANSWER_S = 1.0  # what is left for the requests still running to be answered (a 503, a stream's error event)
SHUTTING_DOWN = "the server is shutting down"


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine when a shutdown (SIGTERM, Ctrl-C) starts: queued requests end at once
    with a 503, running ones get GRACE_S - ANSWER_S to finish and then end with a 503 or a stream's error event, so
    every client is answered before uvicorn cancels what is left."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            self.engine.stop(SHUTTING_DOWN)
            timer = threading.Timer(GRACE_S - ANSWER_S, self.engine.stop, (SHUTTING_DOWN, True))
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


def serve(service: Service, sock: socket.socket, log_level: str = "warning") -> None:
    """Run the app on `sock` (listening_socket) until interrupted; closes the engine, the model and the socket."""
    config = uvicorn.Config(create_app(service), log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=GRACE_S)
    try:
        _Server(config, service.engine).run(sockets=[sock])
    finally:
        sock.close()
        service.engine.close()
        _shutdown(service.engine.model)


def _shutdown(model) -> None:
    """A staged export's Ray actors (and Ray, where the model started it); nothing for an ExportedModel."""
    if isinstance(model, StagedExport) and hasattr(model, "shutdown"):
        model.shutdown()
