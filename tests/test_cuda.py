"""The CUDA path: device-resident caches bound by address, the provider's options, and verify on the GPU.

The first half runs everywhere: resident caches allocated by onnxruntime on the CPU take the very code path a device
takes (allocation, binding by address, in-place writes, uploads and downloads), and a recording binding checks the
calls that path makes for 'cuda'. The second half needs onnxruntime's CUDAExecutionProvider and a visible GPU
(onnxruntime-gpu; docs/gpu.md) and skips, saying which is missing, without them.
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from mla_deploy import io_spec
from mla_deploy.errors import ProviderError
from mla_deploy.export import ExportOptions, export
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from mla_deploy.runtime import cache as cache_module
from mla_deploy.runtime import session as session_module
from mla_deploy.runtime.cache import CacheBuffers, DecodeBinding
from mla_deploy.runtime.dtypes import ONNX, device_value, numpy_dtype
from mla_deploy.runtime.scheduler import Request, Scheduler, TokenEvent
from mla_deploy.verify import COMPUTE_RTOL, RTOL, verify_export

VARIANT = "v2_nolora_greedy_yarn"
PROMPTS = [[5, 9, 2, 7, 1, 3], [8, 8, 4], list(range(10, 30))]
EVEN = [[5, 9, 2, 7, 1, 3], [8, 8, 4, 1, 2, 6]]  # rows of one length: no padded prefill writes past either


def cuda_missing() -> str | None:
    """Why the CUDA tests cannot run here, or None."""
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return (f"onnxruntime {ort.__version__} has no CUDAExecutionProvider (providers: "
                f"{', '.join(ort.get_available_providers())}); install onnxruntime-gpu (docs/gpu.md)")
    try:
        ort.OrtValue.ortvalue_from_shape_and_type([1], np.float32, "cuda", 0)
    except Exception as e:  # onnxruntime's own error types
        return f"CUDAExecutionProvider is present but no GPU is usable ({str(e).strip().splitlines()[0]})"
    return None


needs_cuda = pytest.mark.skipif(cuda_missing() is not None, reason=str(cuda_missing()))


@pytest.fixture(scope="module")
def exports(checkpoint_dir, tmp_path_factory):
    """(dtype, absorb) -> an export of the tiny checkpoint; dtype 'int4' is a float32 export with int4 weights,
    'bfloat16-moe' a bfloat16 one whose routed experts run in onnxruntime's MoE (no control flow), 'float16-f16' a
    float16 one computing in float16 (--compute float16) with them in MoE too."""
    built = {}

    def get(dtype: str, absorb: str = "factored"):
        if (dtype, absorb) not in built:
            out = tmp_path_factory.mktemp(f"cuda-{dtype}-{absorb}") / "out"
            quantize = "int4" if dtype == "int4" else None
            stored, form = dtype.split("-") if "-" in dtype else (dtype, "")
            options = ExportOptions(absorb=absorb, dtype="float32" if quantize else stored, quantize=quantize,
                                    block_size=16 if quantize else None, experts="moe" if form else "branches",
                                    compute="float16" if form == "f16" else "auto")
            export(checkpoint_dir(VARIANT)[0], out, options)
            built[dtype, absorb] = out
        return built[dtype, absorb]

    return get


def greedy(model: ExportedModel, n: int = 8) -> list[list[int]]:
    return Generator(model, SamplingParams(), stop_token_ids=()).generate(PROMPTS, n).token_ids


def scheduled(model: ExportedModel, n: int = 8) -> list[list[int]]:
    scheduler = Scheduler(model, max_batch=4)
    streams = [[] for _ in PROMPTS]
    for p, stream in zip(PROMPTS, streams):
        scheduler.add(Request(p, n, lambda e, s=stream: s.append(e.token) if isinstance(e, TokenEvent) else None))
    for _ in range(200):
        if not scheduler.has_work():
            break
        scheduler.step()
    return streams


# ---- everywhere: the device code path on the CPU ----

def test_cuda_provider_and_its_options_reach_every_session(exports, monkeypatch):
    """With CUDA available, sessions are made for CUDA first with TF32 off, no CPU custom-op library is registered on
    them, and the caches default to resident. onnxruntime's CPU build stands in for the sessions themselves."""
    made = []
    real = ort.InferenceSession

    def recording(path, options, providers=None, provider_options=None):
        made.append((providers, provider_options, options.get_session_config_entry("session.disable_prepacking")))
        return real(path, options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(session_module.ort, "get_available_providers",
                        lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(session_module.ort, "InferenceSession", recording)
    registered = []
    monkeypatch.setattr(ort.SessionOptions, "register_custom_ops_library", lambda self, path: registered.append(path))
    model = ExportedModel(exports("float32"), RuntimeOptions(provider="cuda"))
    assert model.device == "cuda" and model.resident_caches
    assert len(made) == 2 and registered == []
    for providers, options, _ in made:
        assert providers == ["CUDAExecutionProvider", "CPUExecutionProvider"]
        assert options == [{"use_tf32": "0"}, {}]
    assert session_module.provider_options(model.providers, cuda_graph=True)[0] == {"use_tf32": "0",
                                                                                    "enable_cuda_graph": "1"}


def test_cuda_without_the_provider_falls_back_to_host_caches_with_a_warning(exports):
    if cuda_missing() is None:
        pytest.skip("this onnxruntime has the CUDA provider: no fallback to see")
    fallback = r"provider 'cuda' \(CUDAExecutionProvider\) is not available.*onnxruntime-gpu"
    with pytest.warns(RuntimeWarning, match=fallback):
        model = ExportedModel(exports("float32"), RuntimeOptions(provider="cuda"))
    assert model.device == "cpu" and not model.resident_caches
    with pytest.raises(ProviderError, match=r"cannot allocate a bfloat16 tensor \[2, 3\] on 'cuda'"):
        device_value((2, 3), "bfloat16", "cuda")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int4"])
def test_resident_caches_generate_exactly_what_host_caches_do(exports, dtype):
    """The Generator and the continuous-batching scheduler (rows bound by address) over resident caches, against the
    same over numpy caches: the same kernels on the same values, so the same tokens."""
    host = ExportedModel(exports(dtype))
    resident = ExportedModel(exports(dtype), RuntimeOptions(resident_caches=True))
    assert resident.resident_caches and not host.resident_caches
    expected = greedy(host)
    assert greedy(resident) == expected
    assert scheduled(resident) == scheduled(host) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_writes_resident_caches_in_place_at_the_write_index_only(exports, dtype):
    model = ExportedModel(exports(dtype), RuntimeOptions(resident_caches=True))
    gen = Generator(model, SamplingParams(), stop_token_ids=())
    state = gen.new_state([np.array(p) for p in EVEN])
    gen.prefill(state, EVEN)
    caches = state.caches
    assert caches.resident and not caches.arrays  # nothing of them is kept in host memory
    addresses = {name: value.data_ptr() for name, value in caches.values.items()}
    before = {name: caches.host(name) for name in caches.values}
    lengths = state.lengths.copy()
    gen.decode_step(state, np.array([3, 4]))
    binding = state.decode_binding
    assert {name: value.data_ptr() for name, value in caches.values.items()} == addresses
    for name, old in before.items():
        new = caches.host(name)
        assert new.dtype == numpy_dtype(dtype)
        for r, slot in enumerate(lengths):
            assert new[r, slot].any() and not old[r, slot].any()  # the new token's entry, written on the device
            untouched = np.delete(new[r], slot, axis=0) == np.delete(old[r], slot, axis=0)
            assert untouched.all()
    assert binding.transfer_bytes() == {"to_device": 3 * 2 * 8, "to_host": 2 * model.config.vocab_size * 4}


class RecordingBinding:
    """An IOBinding that records what it is asked to bind."""

    def __init__(self):
        self.calls = []

    def bind_input(self, *args):
        self.calls.append(("input", *args))

    def bind_output(self, *args):
        self.calls.append(("output", *args))

    def bind_ortvalue_input(self, name, value):
        self.calls.append(("input value", name, value))

    def bind_ortvalue_output(self, name, value):
        self.calls.append(("output value", name, value))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_resident_caches_on_cuda_allocate_there_and_bind_rows_by_address(exports, monkeypatch, dtype):
    """The calls a 'cuda' cache makes, with onnxruntime's CPU allocator standing in for the device's: every buffer
    and every DecodeBinding input and output is allocated on 'cuda', a run of rows is bound at its address with the
    ONNX element type, and only the ids, positions and write indices go in per step."""
    allocated = []

    def on_cpu(shape, dtype_, device):
        allocated.append((tuple(shape), dtype_, device))
        return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), ONNX[dtype_], "cpu", 0)

    monkeypatch.setattr("mla_deploy.runtime.dtypes.device_value", on_cpu)
    monkeypatch.setattr(cache_module, "device_value", on_cpu)
    model = ExportedModel(exports(dtype))
    cfg = model.config
    caches = CacheBuffers(cfg, 4, 10, model.max_seq_len, "cuda", dtype)
    assert caches.resident and caches.capacity == cache_module.BLOCK
    widths = {t.past: t.width for t in caches.tensors}
    buffers = [((4, caches.capacity, w), dtype, "cuda") for w in widths.values()]
    assert [a for a in allocated if a[1] == dtype] == buffers
    binding = RecordingBinding()
    assert caches.bind(binding, slice(1, 3)) == []
    itemsize = numpy_dtype(dtype).itemsize
    expected = []
    for t in caches.tensors:
        past, present = t.past, t.present
        value, width = caches.values[past], widths[past]
        address = value.data_ptr() + 1 * caches.capacity * width * itemsize
        for kind, name in (("input", past), ("output", present)):
            expected.append((kind, name, "cuda", 0, ONNX[dtype], [2, caches.capacity, width], address))
    assert binding.calls == expected
    with pytest.raises(ValueError, match="consecutive rows"):
        caches.bind(RecordingBinding(), slice(0, 4, 2))

    allocated.clear()
    decode = model.sessions[io_spec.DECODE]
    session = type("Session", (), {"io_binding": lambda self: RecordingBinding(),
                                   "get_outputs": lambda self: decode.get_outputs()})
    d = DecodeBinding(session(), caches, 3, cfg.vocab_size)
    assert d.device == "cuda"
    assert [a for a in allocated if a[1] != dtype] == [((3, 1), "int64", "cuda"), ((3, 1), "int64", "cuda"),
                                                      ((3,), "int64", "cuda"), ((3, caches.capacity), "int64", "cuda"),
                                                      ((3, 1, cfg.vocab_size), "float32", "cuda")]
    assert [a for _, a in d.uploads] == [d.ids, d.pos, d.write]  # the mask went once, at binding
    assert d.transfer_bytes() == {"to_device": 3 * 3 * 8, "to_host": 3 * cfg.vocab_size * 4}
    bound = [c for c in d.binding.calls if c[0].endswith("value")]
    names = [io_spec.INPUT_IDS, io_spec.POSITION_IDS, io_spec.WRITE_INDICES, io_spec.ATTENTION_MASK, io_spec.LOGITS]
    assert [c[1] for c in bound] == names
    assert [c[1] for c in d.binding.calls if c[0] == "input"][0] == io_spec.past_latent(0)
    assert bound[3][2].numpy().all() and bound[3][2].shape() == [3, caches.capacity]  # the mask: ones, uploaded


# ---- with a GPU ----

@needs_cuda
@pytest.mark.parametrize("absorb", ["fused", "factored"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int4", "bfloat16-moe", "float16-f16"])
def test_every_dtype_and_absorb_form_verifies_on_cuda(checkpoint_dir, exports, dtype, absorb):
    """The CPU's tolerance for each dtype (verify.RTOL: float32 1e-4 with TF32 off, halves 1e-3; int4 is compared
    with its dequantized weights at float32's; a float16 compute at verify.COMPUTE_RTOL)."""
    report = verify_export(exports(dtype, absorb), checkpoint_dir(VARIANT)[0], steps=6, provider="cuda")
    assert report.device == "cuda", report.lines
    assert report.passed, report.lines
    expected = {"int4": RTOL["float32"], "bfloat16-moe": RTOL["bfloat16"], "float16-f16": COMPUTE_RTOL["float16"]}
    assert report.rtol == expected.get(dtype, RTOL.get(dtype))


@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16-moe", "float16-f16"])
def test_a_cuda_graph_replays_the_decode_step_of_an_export_without_control_flow(exports, dtype):
    """The same steps with and without a captured CUDA graph, over resident caches of one capacity bound at fixed
    addresses: the same logits, and the caches written in place."""
    model = ExportedModel(exports(dtype, "fused"), RuntimeOptions(provider="cuda"), graphs=(io_spec.DECODE,))
    graph = model.directory / model.manifest["graphs"][io_spec.DECODE]["file"]
    logits = {}
    for cuda_graph in (False, True):
        session = ort.InferenceSession(str(graph), model.session_options(io_spec.DECODE), providers=model.providers,
                                       provider_options=session_module.provider_options(model.providers,
                                                                                        cuda_graph=cuda_graph))
        caches = CacheBuffers(model.config, 2, 32, model.max_seq_len, "cuda", model.cache_format, resident=True)
        d = DecodeBinding(session, caches, 2, model.config.vocab_size)
        steps = []
        for step in range(6):  # onnxruntime captures after its warm-up runs, then replays
            d.ids[:, 0], d.pos[:, 0], d.write[:] = [5 + step, 9 + step], step, step
            d.run(session)
            steps.append(d.logits.copy())
        logits[cuda_graph] = np.stack(steps)
        written = caches.host(io_spec.past_latent(0))
        assert written[:, :6].any(axis=-1).all() and not written[:, 6:].any()
    np.testing.assert_allclose(logits[True], logits[False], rtol=1e-5, atol=1e-5)


@needs_cuda
@pytest.mark.parametrize("absorb", ["fused", "factored"])
def test_float32_greedy_tokens_on_cuda_equal_the_cpu(exports, absorb):
    cpu = ExportedModel(exports("float32", absorb))
    gpu = ExportedModel(exports("float32", absorb), RuntimeOptions(provider="cuda"))
    assert gpu.device == "cuda" and gpu.resident_caches
    expected = greedy(cpu, 12)
    assert greedy(gpu, 12) == expected
    assert scheduled(gpu, 12) == expected


@needs_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_caches_live_on_the_device_and_are_written_in_place(exports, dtype):
    model = ExportedModel(exports(dtype), RuntimeOptions(provider="cuda"))
    gen = Generator(model, SamplingParams(), stop_token_ids=())
    state = gen.new_state([np.array(p) for p in EVEN])
    gen.prefill(state, EVEN)
    caches = state.caches
    assert {v.device_name() for v in caches.values.values()} == {"cuda"}
    addresses = {name: v.data_ptr() for name, v in caches.values.items()}
    lengths = state.lengths.copy()
    logits = gen.decode_step(state, np.array([3, 4]))
    assert np.isfinite(logits).all()
    assert {name: v.data_ptr() for name, v in caches.values.items()} == addresses
    for name in caches.values:
        written = caches.host(name)
        assert all(written[r, slot].any() for r, slot in enumerate(lengths))
        assert not written[:, int(lengths.max()) + 1 :].any()


@needs_cuda
def test_no_cache_crosses_between_host_and_device_in_a_decode_step(exports, tmp_path):
    """onnxruntime's profiler over decode steps on resident caches: any copy between host and device it inserted
    (a node left on the CPU) moves far less than one cache."""
    model = ExportedModel(exports("float16"), RuntimeOptions(provider="cuda"), graphs=(io_spec.DECODE,))
    so = model.session_options()
    so.enable_profiling, so.profile_file_prefix = True, str(tmp_path / "decode")
    graph = model.directory / model.manifest["graphs"][io_spec.DECODE]["file"]
    session = ort.InferenceSession(str(graph), so, providers=model.providers,
                                   provider_options=session_module.provider_options(model.providers))
    cfg = model.config
    caches = CacheBuffers(cfg, 2, 40, model.max_seq_len, "cuda", model.cache_dtype)
    d = DecodeBinding(session, caches, 2, cfg.vocab_size)
    for step in range(4):
        d.ids[:, 0], d.pos[:, 0], d.write[:] = 7, step, step
        d.run(session)
    events = json.loads(open(session.end_profiling()).read())
    copies = [e for e in events if e.get("cat") == "Node" and "Memcpy" in e["args"].get("op_name", "")]
    one_cache = 2 * caches.capacity * cfg.kv_lora_rank * 2
    assert all(int(e["args"].get("output_size", 0)) < one_cache for e in copies), copies
    assert np.isfinite(d.logits).all()


# ---- benchmarks/gpu.py: its code path on the CPU, its refusal without CUDA ----

def _gpu_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("gpu_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_benchmark_jobs_run_on_the_cpu_provider_and_summarise(exports):
    gpu = _gpu_benchmark()
    directory = exports("bfloat16", "fused")
    rate = gpu.decode_rate(directory, "cpu", 2, 16, 2, False, warmup=1)
    cfg = ExportedModel(directory).config
    assert rate["tokens_per_s"] > 0 and rate["capacity"] == cache_module.BLOCK
    assert rate["binding_copies_per_step"] == {"to_device": 3 * 2 * 8, "to_host": 2 * cfg.vocab_size * 4}
    assert rate["cache_bytes_copied_per_step"] == 0
    assert rate["cache_bytes_read_per_step"] == cfg.latent_cache_width * cfg.num_hidden_layers * 2 * 16 * 2
    served = gpu.scheduled_rate(directory, "cpu", 2, 5, 4)
    assert served["decode_tokens_per_s"] > 0 and served["rows_per_decode_step"] > 1
    placed = gpu.placement(directory, "cpu", 1, 16, steps=2)
    assert placed["copy_nodes_per_step"] == 0
    timed = gpu.gpu_kernels(directory, "cpu", 1, 16, steps=2)
    assert timed["wall_ms_per_step"] > 0 and timed["top"] == [] and timed["gpu_busy_ms_per_step"] == 0  # no GPU
    assert set(placed["node_runs_per_step_by_provider"]) == {"CPUExecutionProvider"}
    jobs = {"bandwidth": {"gb_per_s": 100.0}, "decode m/bfloat16/fused batch 1 ctx 16": {**rate, "batch": 1},
            "decode m/bfloat16/fused batch 32 ctx 16": {**rate, "batch": 32, "tokens_per_s": rate["tokens_per_s"] * 12},
            "peer m eager batch 1 ctx 16": {"tokens_per_s": rate["tokens_per_s"] / 4},
            "verify m/bfloat16/fused": {"passed": True}, "verify m/int4/fused": {"error": "x"}}
    summary = gpu.summary(jobs)
    assert summary["verify"] == {"m/bfloat16/fused": "pass", "m/int4/fused": "error"}
    assert summary["batch32_over_batch1_tokens_per_s"] == {"ctx 16 m/bfloat16/fused": 12.0}
    assert summary["onnx_over_transformers_eager"] == {"m/bfloat16/fused batch 1 ctx 16": 4.0}
    fraction = summary["batch1_fraction_of_copy_bandwidth"]["m/bfloat16/fused ctx 16"]
    assert fraction == round(rate["read_gb_per_s"] / 100.0, 3)


@pytest.mark.skipif(cuda_missing() is None, reason="onnxruntime has the CUDA provider here: nothing to refuse")
def test_the_gpu_benchmark_refuses_to_run_without_cuda_with_a_clear_message(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "gpu.json")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "has no CUDAExecutionProvider" in done.stderr and "docs/gpu.md" in done.stderr and "--dry-run" in done.stderr
    assert not (tmp_path / "gpu.json").exists()


def test_the_gpu_benchmark_takes_the_peer_points_of_a_peer_only_run(tmp_path):
    import argparse
    import json

    gpu = _gpu_benchmark()
    peers = tmp_path / "peer.json"
    peers.write_text(json.dumps({"dry_run": True, "jobs": {
        "peer demo eager batch 1 ctx 16": {"tokens_per_s": 10.0}, "peer demo compiled batch 1 ctx 16": {"error": "x"},
        "environment": {"device": "elsewhere"}}}))
    args = argparse.Namespace(dry_run=True, out=str(tmp_path / "gpu.json"), fresh=False, workdir=str(tmp_path),
                              merge=str(peers))
    bench = gpu.Bench(args)
    bench.results["jobs"]["peer demo eager batch 8 ctx 16"] = {"tokens_per_s": 3.0}
    bench.merge_peers()
    jobs = json.loads((tmp_path / "gpu.json").read_text())["jobs"]
    assert jobs["peer demo eager batch 1 ctx 16"] == {"tokens_per_s": 10.0, "merged_from": "peer.json"}
    assert jobs["peer demo eager batch 8 ctx 16"] == {"tokens_per_s": 3.0}  # its own point stays
    assert "peer demo compiled batch 1 ctx 16" not in jobs and "environment" not in jobs  # failures, other jobs: not


def test_the_gpu_benchmark_waits_for_a_live_helper_process_and_not_for_a_dead_ones_marker(tmp_path):
    import argparse
    import subprocess
    import sys
    import time

    gpu = _gpu_benchmark()
    args = argparse.Namespace(dry_run=True, out=str(tmp_path / "gpu.json"), fresh=False, workdir=str(tmp_path),
                              merge=None)
    bench = gpu.Bench(args)
    assert bench.wait_for("prepare") == 0  # none running
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.5)"])
    (tmp_path / "prepare.pid").write_text(str(helper.pid))
    t0 = time.perf_counter()
    bench.wait_for("prepare")
    assert helper.poll() is not None and time.perf_counter() - t0 >= 1.5  # it waited for the process to end
    helper.wait()
    t0 = time.perf_counter()
    bench.wait_for("prepare")  # the marker of an ended process (killed before it could remove it): no wait
    assert time.perf_counter() - t0 < 1
    with bench.running("peer"):
        assert (tmp_path / "peer.pid").read_text() == str(__import__("os").getpid())
    assert not (tmp_path / "peer.pid").exists()
