"""Scale-out on Ray Serve: two replicas on a local Ray instance behind Ray's HTTP proxy, driven by the openai client."""

import socket
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is the optional 'ray' extra: pip install 'mla-deploy[serve,ray]'")
openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai client (test extra)")

from mla_deploy.presets import DEMO_CHECKPOINT  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_replicas_behind_ray_serve_share_the_requests(tmp_path):
    from ray import serve

    from mla_deploy.export import export
    from mla_deploy.serve.ray import deployment

    out = tmp_path / "demo"
    export(DEMO_CHECKPOINT, out)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()  # after Ray's own processes took their ports: one of them took an earlier pick once
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(deployment(out, replicas=2, max_batch=4), name="mla-deploy", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
        greedy = dict(model="demo", temperature=0, extra_body={"repetition_penalty": 1.0})
        seen, texts = set(), set()
        deadline = time.monotonic() + 120
        while len(seen) < 2:
            assert time.monotonic() < deadline, f"only replicas {seen} answered"
            raw = client.completions.with_raw_response.create(prompt="def ", max_tokens=8, **greedy)
            seen.add(raw.headers["x-mla-replica"])
            texts.add(raw.parse().choices[0].text)
        assert len(texts) == 1  # the same export on both: the same greedy text
        chunks = list(client.completions.create(prompt="def ", max_tokens=8, stream=True, **greedy))
        assert "".join(c.choices[0].text for c in chunks) in texts
    finally:
        serve.shutdown()
        ray.shutdown()


def test_a_replica_whose_engine_died_reports_itself_unhealthy():
    """Ray Serve's health check: a dead engine answers every request with a 503, so its replica asks to be replaced
    rather than keep a share of the traffic."""
    from types import SimpleNamespace

    from mla_deploy.serve.ray import Replica

    def replica(error):
        return SimpleNamespace(service=SimpleNamespace(engine=SimpleNamespace(error=error)))

    assert Replica.check_health(replica(None)) is None
    with pytest.raises(RuntimeError, match="the engine failed: OSError"):
        Replica.check_health(replica(OSError("stage lost")))
