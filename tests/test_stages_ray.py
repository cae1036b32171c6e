"""A staged export's stages as Ray actors: on a local Ray instance, and on two Ray nodes started as separate processes
on loopback (`ray start --head`, `ray start --address`), one stage pinned to each; a killed stage is a clear error."""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="pipeline stages on Ray are the optional 'ray' extra: "
                                       "pip install 'mla-deploy[ray]'")

from mla_deploy import io_spec  # noqa: E402
from mla_deploy.errors import StageFailedError  # noqa: E402
from mla_deploy.export import ExportOptions, export  # noqa: E402
from mla_deploy.presets import DEMO_CHECKPOINT  # noqa: E402
from mla_deploy.runtime import ExportedModel, Generator, SamplingParams  # noqa: E402
from mla_deploy.runtime.pipeline import PipelineGenerator  # noqa: E402
from mla_deploy.runtime.stages import StagedModel, no_cluster, stage_resource, unreachable  # noqa: E402

PROMPTS = [[5, 9, 200, 7, 31], [3] * 17, [44, 45, 46, 47, 48, 49, 50, 51, 52], [8], list(range(100, 130))]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-stages")
    built = {}
    for name, options in {"whole": ExportOptions(), "2": ExportOptions(stages=2), "3": ExportOptions(stages=3)}.items():
        built[name] = root / name
        export(DEMO_CHECKPOINT, built[name], options)
    built["tokens"] = Generator(ExportedModel(built["whole"]), SamplingParams(), stop_token_ids=()).generate(
        PROMPTS, 24).token_ids
    return built


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("name", ["2", "3"])
def test_stage_actors_generate_the_whole_exports_tokens(exports, local_ray, name):
    with StagedModel(exports[name]) as model:
        assert len({p["pid"] for p in model.placement}) == int(name)  # one process per stage
        for micro_batches in (1, 2):
            result = PipelineGenerator(model, SamplingParams(), stop_token_ids=(),
                                       micro_batches=micro_batches).generate(PROMPTS, 24)
            assert result.token_ids == exports["tokens"]
        sizes = ray.get([a.describe.remote() for a in model.actors])
        assert all(s["groups"] == 0 for s in sizes)  # every sequence's caches freed on every stage


def test_a_row_is_cleared_on_every_stages_actor_after_the_steps_sent_before(exports, local_ray):
    """StagedModel.clear_row (a failed request's row, StagedScheduler._clear_row) zeroes that row of the group's
    caches on each actor, after the step already sent to it, and no other row."""
    with StagedModel(exports["2"]) as model:
        model.open("g", 2)
        ids = np.array([PROMPTS[0], PROMPTS[0]], np.int64)
        positions = np.arange(ids.shape[1], dtype=np.int64)[None].repeat(2, 0)
        model.forward("g", io_spec.PREFILL, ids, positions, np.zeros(2, np.int64), np.array([[4], [4]]))
        model.clear_row("g", 1)  # sent after the prefill, not waited for

        def rows_written(worker):
            caches = worker.groups["g"]
            return [[bool(caches.host(t.past)[r].any()) for t in caches.tensors] for r in range(2)]

        for actor in model.actors:
            first, second = ray.get(actor.__ray_call__.remote(rows_written))
            assert all(first) and not any(second)


def test_a_cluster_address_where_nothing_answers_is_refused_at_once(exports, monkeypatch):
    """Ray itself retries an address that does not answer for minutes; the address is tried first, named in the
    error, whether it came from --ray-address or RAY_ADDRESS."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    started = time.monotonic()
    with pytest.raises(StageFailedError, match=rf"--ray-address 127.0.0.1:{port}: no Ray cluster answered \("):
        StagedModel(exports["2"], address=f"127.0.0.1:{port}")
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{port}")
    with pytest.raises(StageFailedError, match=rf"RAY_ADDRESS ray://127.0.0.1:{port}: no Ray cluster answered"):
        StagedModel(exports["2"])
    assert time.monotonic() - started < 30 and not ray.is_initialized()
    with socket.socket() as listening:  # accepts, never answers
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        silent = f"127.0.0.1:{listening.getsockname()[1]}"
        assert unreachable(silent, timeout_s=0.5) == no_cluster(silent, "no answer within 0.5 s")
    assert unreachable("auto") is None and unreachable("local") is None  # Ray resolves them: its own error, at once
    monkeypatch.delenv("RAY_ADDRESS")
    assert unreachable("nonsense") == ("--ray-address nonsense: expected HOST:PORT (the head's GCS port, ray start "
                                       "--port), ray://HOST:PORT, auto or local")


def test_an_address_that_answers_but_not_as_ray_is_refused_at_once(exports, monkeypatch):
    """An HTTP server (the dashboard's port given for the GCS's) accepts the connection, and Ray would retry it for
    minutes: the first reply to HTTP/2's preface tells it from Ray's gRPC servers, whose answer is a SETTINGS
    frame."""
    import http.server
    import threading

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{server.server_port}"
        started = time.monotonic()
        with pytest.raises(StageFailedError, match=rf"--ray-address {address}: no Ray cluster answered \(it answers, "
                                                   r"but not as Ray's gRPC port does: give the head's GCS port"):
            StagedModel(exports["2"], address=address)
        assert time.monotonic() - started < 10 and not ray.is_initialized()
    finally:
        server.shutdown()


def test_a_stage_that_cannot_load_is_its_own_one_line_error(exports, local_ray, tmp_path):
    """A stage's weights truncated: the load's ExportLoadError naming the file reaches the caller whole (an error in
    an actor's constructor would arrive as an ActorDiedError holding it as text), and Ray's own GCS answers the
    address probe."""
    from mla_deploy.errors import ExportLoadError

    assert unreachable(ray.get_runtime_context().gcs_address) is None
    broken = tmp_path / "2"
    shutil.copytree(exports["2"], broken)
    weights = broken / "stage-1" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ExportLoadError, match=r"stage-1/weights.bin: \d+ bytes, the manifest says \d+: truncated"):
        StagedModel(broken)


def test_a_terminated_run_over_ray_stops_cleanly(exports, tmp_path):
    """SIGTERM to `mla-deploy run` on a staged export: the CLI's clean stop ("interrupted", exit 130, its Ray
    instance shut down), not Ray's crash report (Ray installs its own SIGTERM handler when it starts)."""
    import signal

    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        run = subprocess.Popen([shutil.which("mla-deploy", path=os.path.dirname(sys.executable)), "run",
                                str(exports["2"]), "--prompt-ids", "5,9,200", "-n", "1000", "--temperature", "0"],
                               stdout=subprocess.PIPE, stderr=stderr)
    try:
        assert run.stdout.read(1), err.read_text()  # tokens are streaming: the stages are up
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 130
    finally:
        run.kill()
    said = err.read_text()
    assert said.rstrip().splitlines()[-1] == "interrupted" and "SIGTERM received" not in said, said


def test_a_killed_stage_is_a_clear_error_not_a_hang(exports, local_ray):
    with StagedModel(exports["2"]) as model:
        ray.kill(model.actors[1])
        start = time.monotonic()
        with pytest.raises(StageFailedError, match=r"stage 1 \(layers 2-3\): its Ray actor died"):
            PipelineGenerator(model, SamplingParams(), stop_token_ids=()).generate(PROMPTS, 8)
        assert time.monotonic() - start < 60


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


DRIVER = """
import json, sys
from mla_deploy.runtime import SamplingParams
from mla_deploy.runtime.pipeline import PipelineGenerator
from mla_deploy.runtime.stages import StagedModel
export_dir, address, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with StagedModel(export_dir, address=address) as model:
    result = PipelineGenerator(model, SamplingParams(), stop_token_ids=(), micro_batches=2).generate(prompts, 24)
    print(json.dumps({"tokens": result.token_ids, "placement": model.placement}))
"""


def ray_node(head: str | None, resources: dict, tmp: Path, env: dict) -> subprocess.Popen:
    """`ray start --block` as its own process: a head (head=None) or a node joining `head`, every port its own, so
    that two nodes share this host and no other Ray on it. Terminating it stops that node's processes."""
    agent, grpc, metrics, env_agent, client, port = free_ports(6)
    args = [RAY_CLI, "start", "--block", "--num-cpus", "1", "--resources", json.dumps(resources),
            "--node-ip-address", "127.0.0.1", "--dashboard-agent-listen-port", str(agent),
            "--dashboard-agent-grpc-port", str(grpc), "--metrics-export-port", str(metrics),
            "--runtime-env-agent-port", str(env_agent), "--disable-usage-stats"]
    if head is None:
        args += ["--head", "--port", str(port), "--include-dashboard", "false", "--ray-client-server-port", str(client),
                 "--temp-dir", str(tmp)]
    else:
        args += ["--address", head]
    log = open(tmp / f"ray-{'head' if head is None else 'node'}.log", "w")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    process.address = f"127.0.0.1:{port}"
    return process


RAY_CLI = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"


def test_two_ray_nodes_each_run_one_stage(exports):
    """The head offers stage 0's resource, the second node stage 1's; the driver is a third process, as on real hosts,
    every one of them holding the cluster's token."""
    temp = Path(tempfile.mkdtemp(prefix="mla-ray-", dir="/tmp"))  # Ray's socket paths must fit in 107 bytes
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    nodes = [ray_node(None, {stage_resource(0): 1}, temp, env)]
    try:
        head = nodes[0].address
        deadline = time.monotonic() + 120
        while True:  # the head's GCS port accepts connections once it is up
            assert nodes[0].poll() is None, (temp / "ray-head.log").read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", int(head.split(":")[1])), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the Ray head did not come up"
                time.sleep(1)
        nodes.append(ray_node(head, {stage_resource(1): 1}, temp, env))
        driver = subprocess.run([sys.executable, "-c", DRIVER, str(exports["2"]), head, json.dumps(PROMPTS)], env=env,
                                capture_output=True, text=True, timeout=300)
        assert driver.returncode == 0, driver.stderr[-3000:]
        out = json.loads(driver.stdout.strip().splitlines()[-1])
        assert out["tokens"] == exports["tokens"]
        assert len({p["node_id"] for p in out["placement"]}) == 2  # stage 0 on the head, stage 1 on the other node
    finally:
        for node in reversed(nodes):
            node.terminate()
            node.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def test_serve_runs_a_staged_export_on_ray_and_reports_a_dead_stage(exports):
    """`mla-deploy serve` on a staged export: one Ray actor per stage (a local Ray instance the server starts), the
    prompts of one request batched through them, the whole export's greedy text; /health names the stages; a
    stage killed is a clear error for the request that meets it, and /health then answers 503 naming it."""
    import httpx2 as httpx
    import openai

    from mla_deploy.manifest import read_manifest
    from mla_deploy.runtime.text import Tokenizer

    port = free_ports(1)[0]
    exe = Path(sys.executable).with_name("mla-deploy")
    server = subprocess.Popen([str(exe), "serve", str(exports["2"]), "--port", str(port), "--max-batch", "4",
                               "--model-name", "m", "--threads", "1"], stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                health = httpx.get(base + "/health", timeout=2)
                if health.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        stages = health.json()["stages"]
        assert [s["index"] for s in stages] == [0, 1] and len({s["pid"] for s in stages}) == 2

        manifest = read_manifest(exports["2"])
        tokenizer = Tokenizer.from_export(exports["2"], manifest)
        stops = set(manifest["config_obj"].eos_token_id)
        expected = []
        # the text up to the first stop token, which the server leaves out; the last prompt's continuation is bytes
        # that are no whole UTF-8 text
        for tokens in exports["tokens"][:4]:
            cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
            expected.append(tokenizer.decode(tokens[:cut]))
        assert all(expected)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.completions.create(model="m", prompt=PROMPTS[:4], max_tokens=24, temperature=0,
                                          extra_body={"repetition_penalty": 1.0})
        assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected

        os.kill(stages[1]["pid"], 9)
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="m", prompt=PROMPTS[:1], max_tokens=8, temperature=0)
        assert failed.value.status_code == 503 and "stage 1" in failed.value.message
        health = httpx.get(base + "/health", timeout=60)
        assert health.status_code == 503 and "StageFailedError" in health.text and "stage 1" in health.text
    finally:
        server.terminate()
        server.wait(timeout=60)

