"""A real OpenAI-compatible server for the tests: the demo export served by uvicorn on a free localhost port."""

import socket
import threading
import time
from contextlib import contextmanager

from mla_deploy.runtime import ExportedModel
from mla_deploy.runtime.chat import ChatTemplate
from mla_deploy.runtime.engine import Engine
from mla_deploy.serve.app import Service, create_app

MODEL = "demo"


@contextmanager
def running_server(export_dir, **engine_args):
    """A real uvicorn server on a free port, on a thread; yields (base_url, service)."""
    import uvicorn

    api_key, instance = engine_args.pop("api_key", None), engine_args.pop("instance", None)
    limit, template = engine_args.pop("max_body_bytes", 64 * 1024), engine_args.pop("chat_template", None)
    parser, origins = engine_args.pop("reasoning_parser", None), engine_args.pop("allowed_origins", ())
    template = None if template is None else ChatTemplate.from_export(export_dir, template)
    service = Service(Engine(ExportedModel(export_dir), **engine_args), MODEL, api_key, max_body_bytes=limit,
                      chat_template=template, reasoning_parser=parser, allowed_origins=origins)
    service.instance = instance  # a Ray Serve replica's id
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", service
    finally:
        server.should_exit = True
        thread.join(10)
        service.engine.close()
        sock.close()



def greedy(**kw):
    """Plain greedy: the demo's generation_config.json also sets a repetition penalty, which greedy keeps."""
    return dict(model=MODEL, temperature=0, extra_body={"repetition_penalty": 1.0}, **kw)
