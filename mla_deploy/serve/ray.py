"""Scale-out on Ray Serve (the 'ray' extra): N replicas, each one export, one Engine and the same OpenAI routes,
behind Ray Serve's HTTP proxy, which spreads requests over them.

    mla-deploy serve OUT --ray-replicas 2                     # starts a local Ray instance
    serve run mla_deploy.serve.ray:app export_dir=OUT replicas=2   # or Ray's own CLI (`app` is an app builder)

Every reply carries `X-MLA-Replica`, the replica that generated it.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ray import serve

from ..errors import ServeError
from ..runtime import RuntimeOptions
from ..runtime.chat import ChatTemplate, is_inline_template
from ..runtime.stages import unreachable
from ..runtime.speculative import Speculation
from .app import create_app
from .server import build_service


@serve.ingress()
class Replica:
    def __init__(self, export_dir: str, max_batch: int, max_queue: int, api_key: str | None, model_name: str | None,
                 options: RuntimeOptions, speculation: Speculation | None = None, prefill_chunk: int = 256,
                 prefix_caching: bool = True, chat_template: str | None = None, reasoning_parser: str | None = None,
                 cache_reuse: int = 0, allowed_origins: tuple[str, ...] = ()):
        self.service = build_service(export_dir, max_batch, max_queue, api_key, model_name, options, prefill_chunk,
                                     speculation, prefix_caching=prefix_caching, chat_template=chat_template,
                                     reasoning_parser=reasoning_parser, cache_reuse=cache_reuse,
                                     allowed_origins=allowed_origins)
        self.service.instance = serve.get_replica_context().replica_id.unique_id

    def __serve_build_asgi_app__(self):
        return create_app(self.service)

    def check_health(self) -> None:
        """Ray Serve asks every few seconds: a replica whose engine died (it answers every request with a 503) is
        reported unhealthy, so Ray replaces it instead of sending it a share of the traffic."""
        if self.service.engine.error is not None:
            raise RuntimeError(f"the engine failed: {self.service.engine.error!r}")


def deployment(export_dir: str | Path, replicas: int, max_batch: int = 16, max_queue: int = 256,
               api_key: str | None = None, model_name: str | None = None, options: RuntimeOptions | None = None,
               speculation: Speculation | None = None, prefill_chunk: int = 256, prefix_caching: bool = True,
               chat_template: str | Path | None = None, reasoning_parser: str | None = None, cache_reuse: int = 0,
               allowed_origins: tuple[str, ...] = ()):
    """The bound Ray Serve application. Each replica reserves an equal share of the CPUs and runs onnxruntime on
    that many threads (unless options.threads says otherwise), so replicas do not fight over cores."""
    cpus = max(1, (os.cpu_count() or 1) // replicas)
    options = options or RuntimeOptions()
    if options.threads == 0:
        options = replace(options, threads=cpus)
    export_dir = str(Path(export_dir).resolve())
    name = model_name or Path(export_dir).name
    return serve.deployment(Replica, name="mla-deploy", num_replicas=replicas,
                            ray_actor_options={"num_cpus": cpus},
                            max_ongoing_requests=max_batch + max_queue,  # queueing is the Engine's job, not Ray's
                            ).bind(export_dir, max_batch, max_queue, api_key, name, options, speculation,
                                   prefill_chunk, prefix_caching,
                                   chat_template if chat_template is None or is_inline_template(chat_template)
                                   else str(Path(chat_template).resolve()),
                                   reasoning_parser, cache_reuse, tuple(allowed_origins))


def app(args: dict):
    """Application builder for `serve run mla_deploy.serve.ray:app export_dir=OUT replicas=N`."""
    return deployment(args["export_dir"], int(args.get("replicas", 1)), int(args.get("max_batch", 16)),
                      int(args.get("max_queue", 256)), args.get("api_key"), args.get("model_name"),
                      chat_template=args.get("chat_template"), reasoning_parser=args.get("reasoning_parser"))


def serve_on_ray(export_dir, replicas: int, host: str, port: int, max_batch: int, max_queue: int,
                 api_key: str | None, model_name: str | None, options: RuntimeOptions,
                 speculation: Speculation | None = None, address: str | None = None, prefill_chunk: int = 256,
                 prefix_caching: bool = True, chat_template: str | Path | None = None,
                 reasoning_parser: str | None = None, cache_reuse: int = 0,
                 allowed_origins: tuple[str, ...] = ()) -> None:
    """Start a local Ray instance (or join `address`, else RAY_ADDRESS), run the replicas, and block until
    interrupted."""
    import ray

    problem = unreachable(address)
    if problem:
        raise ServeError(problem)
    if chat_template is not None:  # a bad file is said here, not by every replica
        ChatTemplate.from_export(export_dir, chat_template)
    joined = address or os.environ.get("RAY_ADDRESS")
    ray.init(address=joined, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(deployment(export_dir, replicas, max_batch, max_queue, api_key, model_name, options, speculation,
                             prefill_chunk, prefix_caching, chat_template, reasoning_parser, cache_reuse,
                             allowed_origins),
                  name="mla-deploy", route_prefix="/", blocking=True)
    finally:  # Ctrl-C or SIGTERM: take the replicas down with us, and Serve where the Ray instance is ours alone
        if joined:  # a cluster's other Serve applications are not ours to stop
            serve.delete("mla-deploy")
        else:
            serve.shutdown()
        ray.shutdown()
