"""The CUDA measurement in one command: exports verified on onnxruntime's CUDA provider, decode throughput with and
without CUDA graphs, transformers on the same GPU, the GPU's copy bandwidth, and what crosses host and device per step.

    python3 benchmarks/gpu.py [--workdir /tmp/mla-gpu] [--out benchmarks/results/gpu.json] [--budget-s 540]
    python3 benchmarks/gpu.py --dry-run     # CPUExecutionProvider, the demo only, tiny sizes: the code path, no figures

Needs onnxruntime-gpu (CUDAExecutionProvider), torch with CUDA, transformers; how to bring onnxruntime-gpu to a lent
GPU machine: docs/gpu.md. Without the CUDA provider it stops with that message (no traceback).

Jobs, in this order (an export is verified before it is timed; the headline export, the first model's first dtype
and form, first of all), each recorded in the results JSON as soon as it is done:
  environment   device name, driver, versions; the GPU's device-to-device copy bandwidth (torch, CUDA events;
                bytes read plus bytes written)
  per model (`mla-deploy preset v2lite-2L`, then the demo), per export (bfloat16 with onnxruntime's MoE for the
  routed experts, the same in float16 computing in float16, bfloat16, float16, float32, int4 weights over float32
  in onnxruntime's MatMulNBits and in mla_deploy's ops: EXPORTS, the last slow to load and so last of all; fused and
  factored absorb forms), built under --workdir unless there already (--prepare builds them alone, several at a
  time, with no GPU needed):
    verify      `verify_export(provider='cuda')`: every graph's logits against the torch source at the CPU's
                tolerance for the export (verify.RTOL, COMPUTE_RTOL), the runtime's greedy tokens over
                device-resident caches
    decode      tokens/s at batch 1/8/32/64 (context 128; batch 1 and 8 also at 4k and 16k for the half exports),
                each with and without a CUDA graph (an export whose graph cannot be captured fails once and its
                other CUDA-graph points say so): resident caches of a fixed capacity filled with random values,
                one DecodeBinding, warm-up steps, then timed steps (each step copies its ids in and logits out)
    placement   onnxruntime's profiler over decode steps: nodes per execution provider, and the bytes of every
                host<->device copy node it inserted per step, beside the binding's own copies by construction
    gpu kernels torch's profiler (CUPTI) over decode steps: the GPU's busy time per step beside the wall time, and
                the kernels that take it, by name
    scheduler   (the headline export only) `serve`'s continuously batching Scheduler without HTTP, batch
                1/8/32/64 requests of 128 prompt tokens and 64 new ones: decode tokens/s while every row decodes
  tests         (after the headline export's points) tests/test_cuda.py's CUDA tests in a child pytest: its summary
                line and the names of any failures (--no-tests leaves it out)
  peer          transformers' AutoModelForCausalLM on the same checkpoint (its DeepseekV2/V3 class), bfloat16, sdpa,
                eager and torch.compile, batch 1 and 8, context 128/4k/16k (each step from a fresh cache of
                exactly that context, built outside the timer). `--peer-only` times them alone (torch only, no
                onnxruntime-gpu: a lent machine runs it while onnxruntime-gpu is on its way); a later run given
                `--merge` that file waits for that process to end and takes its points
A job that fails records its error and the run goes on. When --budget-s runs out the remaining jobs are left for the
next run: the same command again skips every job already in --out (that is how a 10-minute command limit is met).
The summary (computed on every write) gives the issue's ratios from what is there.

--dry-run runs the same code on the CPU provider with the demo at tiny sizes and writes to
benchmarks/results/gpu-dry-run.json, labelled as such: it proves the code path, its figures are no GPU figures.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a plain checkout (PYTHONPATH-free) on a machine without the package installed

import onnxruntime as ort  # noqa: E402

from mla_deploy import io_spec  # noqa: E402
from mla_deploy.presets import DEMO_CHECKPOINT  # noqa: E402

# the exports measured, by name: their ExportOptions beyond the absorb form. bfloat16-moe: the routed experts in
# onnxruntime's com.microsoft MoE (no control flow: a CUDA graph can capture the step) where the others of V2-Lite's
# shape run them as If branches, whose conditions the host reads; float16-f16: the same computing in float16
# (--compute float16: onnxruntime's MatMul and MoE over the weights as stored, where the others' function bodies
# multiply float32 copies made at load); int4: mla_deploy's QMatMul4 ops, whose function
# bodies run on CUDA (weights dequantized once, at load); int4-nbits: onnxruntime's MatMulNBits /
# GatherBlockQuantized, which have CUDA kernels (experts as branches)
EXPORTS = {"bfloat16-moe": {"dtype": "bfloat16", "experts": "moe"},
           "float16-f16": {"dtype": "float16", "compute": "float16", "experts": "moe"},
           "bfloat16": {"dtype": "bfloat16"}, "float16": {"dtype": "float16"}, "float32": {"dtype": "float32"},
           "int4-nbits": {"quantize": "int4", "quantized_ops": "onnxruntime", "experts": "branches"},
           "int4": {"quantize": "int4"}}
DTYPES = tuple(EXPORTS)
# exports whose sessions take minutes to create on CUDA (v2lite-2L int4 in QMatMul4 bodies: 203 s for verify's three
# graphs, onnxruntime folding every dequantized weight on the host): verified with their own timings, not first
SLOW_TO_LOAD = ("int4",)
FORMS = ("fused", "factored")
HALF = ("bfloat16", "float16")


class Bench:
    def __init__(self, args):
        self.args, self.started = args, time.perf_counter()
        self.dry = args.dry_run
        self.provider = "cpu" if self.dry else "cuda"
        self.out = Path(args.out or ROOT / "benchmarks" / "results" / ("gpu-dry-run.json" if self.dry else "gpu.json"))
        self.results = json.loads(self.out.read_text()) if self.out.is_file() and not args.fresh else {}
        if self.results.get("dry_run", self.dry) != self.dry:
            held = "dry-run" if self.results["dry_run"] else "GPU"
            raise SystemExit(f"{self.out} holds {held} results; give another --out")
        self.results.setdefault("jobs", {})
        self.workdir = Path(args.workdir)

    # ---- bookkeeping ----
    def save(self) -> None:
        r = self.results
        r.update(title="mla-deploy on onnxruntime's CUDA provider (benchmarks/gpu.py)", dry_run=self.dry,
                 command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                 updated=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        if self.dry:
            r["note"] = ("DRY RUN on CPUExecutionProvider with the demo at tiny sizes: proves the code path; "
                         "these are not GPU figures")
        r["summary"] = summary(r["jobs"])
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(r, indent=1) + "\n")
        tmp.replace(self.out)
        if os.environ.get("OUT"):  # a lent machine's folder that comes back, even when the command is cut short
            shutil.copy(self.out, Path(os.environ["OUT"]) / self.out.name)

    def job(self, key: str, fn, *a, **kw) -> dict | None:
        if key in self.results["jobs"] and not self.results["jobs"][key].get("error"):
            return self.results["jobs"][key]
        if time.perf_counter() - self.started > self.args.budget_s:
            self.results.setdefault("pending", [])
            if key not in self.results["pending"]:
                self.results["pending"].append(key)
            return None
        print(f"[{time.perf_counter() - self.started:6.0f} s] {key}", flush=True)
        t0 = time.perf_counter()
        try:
            result = fn(*a, **kw)
        except Exception as e:  # one job's failure is a finding, recorded; the others still run
            frame = traceback.extract_tb(e.__traceback__)[-1]
            result = {"error": f"{type(e).__name__}: {str(e).strip()[:600]}",
                      "at": f"{Path(frame.filename).name}:{frame.lineno}"}
            print(f"    failed: {result['error']}", flush=True)
        result["seconds"] = round(time.perf_counter() - t0, 2)
        gc.collect()  # a job's sessions, caches and CUDA graphs
        self.results["jobs"][key] = result
        if key in self.results.get("pending", []):
            self.results["pending"].remove(key)
        self.save()
        return result

    # ---- the plan ----
    def run(self) -> None:
        a = self.args
        self.job("environment", environment, self.dry)
        self.job("bandwidth", bandwidth, self.dry)
        models, dtypes, forms = ["demo"] if self.dry else a.models.split(","), a.dtypes.split(","), a.forms.split(",")
        short, every = ((128,), (128,)) if self.dry else ((128,), (128, 4096, 16384))
        self.merge_peers()  # the peers timed by a --peer-only process while onnxruntime-gpu was on its way
        if waited := self.wait_for("prepare"):  # exports a --prepare process is still building
            self.results["waited_for_prepare_s"] = waited
        fast = [d for d in dtypes if d not in SLOW_TO_LOAD]
        # correctness first: the headline export (the first model, dtype and form) verified, then its points and
        # serve's scheduler on it; every other export of the first model that loads in seconds verified, then timed
        if fast:
            self.verify_jobs(models[0], fast[0], forms[0])
            self.export_jobs(models[0], fast[0], forms[0])
        self.peer_jobs(models[0], False, every)
        self.peer_jobs(models[0], True, short)
        if not self.dry and not a.no_tests:  # the CUDA tests on this machine, recorded with the figures
            self.job("tests/test_cuda.py", cuda_tests)
        for dtype in fast:
            for form in forms:
                self.verify_jobs(models[0], dtype, form)
        for dtype in fast:
            for form in forms:
                self.export_jobs(models[0], dtype, form)
        for name in models[1:]:  # the other models' verify, then their points
            for dtype in fast:
                for form in forms:
                    self.verify_jobs(name, dtype, form)
        for name in models[1:]:
            for dtype in fast:
                for form in forms:
                    self.export_jobs(name, dtype, form)
        self.peer_jobs(models[0], True, every)  # torch.compile compiles once per shape: the long contexts last
        for name in models:  # the exports that take minutes to load, last
            for dtype in (d for d in dtypes if d in SLOW_TO_LOAD):
                for form in forms:
                    self.export_jobs(name, dtype, form)
        left = self.results.get("pending", [])
        self.save()
        print(f"wrote {self.out}" + (f"; {len(left)} jobs left for the next run (same command)" if left else ""))

    def run_peers(self) -> None:
        """--peer-only: transformers on the first model, eager then compiled, every batch and context; the GPU's
        only user while it runs (a lent machine runs it while onnxruntime-gpu is still on its way)."""
        models = ["demo"] if self.dry else self.args.models.split(",")
        every = (128,) if self.dry else (128, 4096, 16384)
        with self.running("peer"):
            self.job("environment", environment, self.dry)
            self.peer_jobs(models[0], False, every)
            self.peer_jobs(models[0], True, every)
            self.save()
        print(f"wrote {self.out}")

    @contextlib.contextmanager
    def running(self, role: str):
        """`role`'s pid in --workdir while this process does it: what a later run waits on (`wait_for`), where a
        shell's `pgrep -f` would also find the shell whose own command line names the process."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        marker = self.workdir / f"{role}.pid"
        marker.write_text(str(os.getpid()))
        try:
            yield
        finally:
            marker.unlink(missing_ok=True)

    def wait_for(self, role: str) -> float:
        """Seconds waited for a `--prepare` / `--peer-only` process of this --workdir to end."""
        marker, t0 = self.workdir / f"{role}.pid", time.perf_counter()
        while marker.is_file():
            try:
                state = Path(f"/proc/{int(marker.read_text())}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (ValueError, OSError):  # ended without removing it (killed)
                break
            if state in ("Z", "X"):  # ended, not yet reaped by its parent
                break
            if time.perf_counter() - t0 < 1:
                print(f"waiting for the {role} process to finish", flush=True)
            time.sleep(1)
        return round(time.perf_counter() - t0, 1)

    def merge_peers(self) -> None:
        """Wait for a running `--peer-only` process (its timings want the GPU to themselves), then take the peer
        jobs of --merge that this run has not recorded."""
        if not self.args.merge:
            return
        waited = self.wait_for("peer")
        source = Path(self.args.merge)
        if not source.is_file():
            print(f"--merge {source}: no such file; the peers run here", flush=True)
            return
        jobs = self.results["jobs"]
        for key, value in json.loads(source.read_text()).get("jobs", {}).items():
            if key.startswith("peer ") and not value.get("error") and (key not in jobs or jobs[key].get("error")):
                jobs[key] = {**value, "merged_from": source.name}
        self.results["waited_for_peers_s"] = waited
        self.save()

    def checkpoint(self, name: str) -> Path:
        if name == "demo":
            return DEMO_CHECKPOINT
        from mla_deploy.presets import build_preset

        path = self.workdir / "checkpoints" / name
        if not (path / "config.json").is_file():
            build_preset(name, path)
        return path

    def export_build(self, name: str, dtype: str, form: str) -> tuple[Path, Path, str, str, int]:
        """build_export's arguments for one export: checkpoint, directory, dtype, form, maximum length."""
        max_len = min(self.args.max_seq_len, 1024) if name == "demo" else self.args.max_seq_len
        return self.checkpoint(name), self.workdir / "exports" / f"{name}-{dtype}-{form}", dtype, form, max_len

    def export_dir(self, name: str, dtype: str, form: str) -> Path:
        build = self.export_build(name, dtype, form)
        if not (build[1] / "manifest.json").is_file():
            build_export(*build)
        return build[1]

    def prepare(self) -> None:
        """Checkpoints and exports only (no onnxruntime needed), `--jobs` exports at a time: what a lent machine
        builds in the background while the rest of onnxruntime-gpu is still on its way."""
        from concurrent.futures import ProcessPoolExecutor
        import multiprocessing

        a = self.args
        todo = [build for name in a.models.split(",") for dtype in a.dtypes.split(",") for form in a.forms.split(",")
                if not ((build := self.export_build(name, dtype, form))[1] / "manifest.json").is_file()]
        spawn = multiprocessing.get_context("spawn")
        with self.running("prepare"), ProcessPoolExecutor(a.jobs, mp_context=spawn) as pool:
            for args, done in zip(todo, pool.map(_build_logged, todo)):
                print(f"[{time.perf_counter() - self.started:6.0f} s] {args[1].name}: {done}", flush=True)

    def verify_jobs(self, name: str, dtype: str, form: str) -> Path | None:
        key = f"{name}/{dtype}/{form}"
        built = self.job(f"export {key}", lambda: {"path": str(self.export_dir(name, dtype, form))})
        if built is None or built.get("error"):
            return None
        directory = Path(built["path"])
        self.job(f"verify {key}", lambda: verify(directory, self.checkpoint(name), self.provider))
        return directory

    def export_jobs(self, name: str, dtype: str, form: str) -> None:
        a, key = self.args, f"{name}/{dtype}/{form}"
        directory = self.verify_jobs(name, dtype, form)
        if directory is None:
            return
        half = EXPORTS[dtype].get("dtype") in HALF
        contexts = [128] if self.dry else [128] + ([4096, 16384] if half and form == "fused" else [])
        for ctx in contexts:
            batches = a.batches.split(",") if ctx == 128 else [b for b in ("1", "8") if b in a.batches.split(",")]
            for batch in batches:
                for graph in (False, True) if not self.dry else (False,):
                    point = f"decode {key} batch {batch} ctx {ctx}{' cuda-graph' if graph else ''}"
                    if graph and (failed := self.graph_failed(key)):  # one capture that cannot work says so
                        self.results["jobs"].setdefault(point, {"skipped": f"a CUDA graph failed on {failed}"})
                        continue
                    self.job(point, decode_rate, directory, self.provider, int(batch), ctx, a.steps, graph)
        self.job(f"placement {key}", placement, directory, self.provider, 1, 128)
        self.job(f"gpu kernels {key}", gpu_kernels, directory, self.provider, 1, 128)
        if (dtype, form) == (a.dtypes.split(",")[0], a.forms.split(",")[0]):  # serve's engine, on the headline export
            for batch in a.batches.split(","):
                self.job(f"scheduler {key} batch {batch}", scheduled_rate, directory, self.provider, int(batch),
                         16 if self.dry else 128, 4 if self.dry else 64)

    def graph_failed(self, key: str) -> str | None:
        """The first point of export `key` whose CUDA-graph session failed (a graph with control flow or host nodes
        cannot be captured, whatever the batch)."""
        for point, value in self.results["jobs"].items():
            if point.startswith(f"decode {key} ") and point.endswith("cuda-graph") and value.get("error"):
                return point
        return None

    def peer_jobs(self, name: str, compiled: bool, contexts: tuple[int, ...]) -> None:
        for batch in (1, 8):
            for ctx in contexts:
                self.job(f"peer {name} {'compiled' if compiled else 'eager'} batch {batch} ctx {ctx}",
                         lambda: peer(self.checkpoint(name), self.dry, batch, ctx, self.args.steps, compiled))


# ---- jobs ----

def build_export(checkpoint: Path, path: Path, dtype: str, form: str, max_len: int) -> None:
    from mla_deploy.export import ExportOptions, export

    export(checkpoint, path, ExportOptions(absorb=form, max_seq_len=max_len, force=True, **EXPORTS[dtype]))


def _build_logged(args) -> str:
    t0 = time.perf_counter()
    try:
        build_export(*args)
    except Exception as e:  # the measuring run builds it again and records the error
        return f"failed: {type(e).__name__}: {str(e).strip()[:300]}"
    return f"built in {time.perf_counter() - t0:.0f} s"


def environment(dry: bool) -> dict:
    info = {"onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
            "python": platform.python_version(),
            "provider": "CPUExecutionProvider" if dry else "CUDAExecutionProvider"}
    try:
        import torch
        import transformers

        info.update(torch=torch.__version__, transformers=transformers.__version__, torch_cuda=torch.version.cuda)
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info.update(device=p.name, memory_gib=round(p.total_memory / 2**30, 1),
                        multiprocessors=p.multi_processor_count)
    except ImportError as e:
        info["torch"] = f"missing ({e.name})"
    if dry:
        info["device"] = f"CPU ({platform.processor() or platform.machine()}), dry run: not a GPU"
    smi = shutil.which("nvidia-smi")
    if smi and not dry:
        line = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
        info["nvidia_smi"] = line
    return info


def bandwidth(dry: bool, mbytes: int = 2048, repeats: int = 20) -> dict:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (what a copy moves through memory)."""
    if dry:
        a = np.ones(64 * 2**20 // 4, np.float32)
        b = np.empty_like(a)
        best = min(_timed(lambda: np.copyto(b, a)) for _ in range(5))
        return {"what": "host memcpy (dry run: not the GPU)", "gb_per_s": round(2 * a.nbytes / best / 1e9, 1)}
    import torch

    a = torch.ones(mbytes * 2**20 // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / repeats
    return {"what": f"torch copy_ of {mbytes} MiB on the GPU, mean of {repeats} after 3 warm-ups (CUDA events)",
            "gb_per_s": round(2 * a.numel() * 4 / seconds / 1e9, 1)}


def verify(directory: Path, checkpoint: Path, provider: str) -> dict:
    from mla_deploy.verify import verify_export

    report = verify_export(directory, checkpoint, steps=8, provider=provider)
    return {"passed": report.passed, "device": report.device, "worst_abs_logit": report.worst,
            "tolerance": report.tolerance, "rtol": report.rtol, "token_agreement": report.token_agreement,
            "lines": report.lines}


_MODEL: dict = {}  # the decode-only model of the export being measured: loaded once for its points


def _model(directory: Path, provider: str):
    from mla_deploy.runtime import ExportedModel, RuntimeOptions

    if _MODEL.get("key") != (directory, provider):
        _MODEL.clear()
        gc.collect()  # the previous export's sessions and their device memory go first
        # resident caches on the CPU too: a dry run takes the device's code path (binding by address, copies)
        _MODEL.update(key=(directory, provider), model=ExportedModel(
            directory, RuntimeOptions(provider=provider, resident_caches=True), graphs=(io_spec.DECODE,)))
    return _MODEL["model"]


def _session(model, cuda_graph: bool, profile_prefix: str | None = None) -> ort.InferenceSession:
    from mla_deploy.runtime.session import provider_options

    so = model.session_options(io_spec.DECODE)
    if profile_prefix:
        so.enable_profiling, so.profile_file_prefix = True, profile_prefix
    graph = model.directory / model.manifest["graphs"][io_spec.DECODE]["file"]
    return ort.InferenceSession(str(graph), so, providers=model.providers,
                                provider_options=provider_options(model.providers, cuda_graph=cuda_graph))


def _filled_caches(model, batch: int, capacity: int, rng: np.random.Generator):
    """Resident caches of `capacity` slots, every slot holding standard normal values in the cache dtype."""
    from mla_deploy.runtime.cache import CacheBuffers
    from mla_deploy.runtime.dtypes import numpy_dtype, ort_value
    from mla_deploy.safetensors_io import float32_to_bf16

    caches = CacheBuffers(model.config, batch, capacity, model.max_seq_len, model.device, model.cache_format,
                          resident=model.resident_caches)
    for name, value in caches.values.items():
        dtype = caches.dtypes[name]
        values = rng.standard_normal(value.shape(), dtype=np.float32)
        values = float32_to_bf16(values) if dtype == "bfloat16" else values.astype(numpy_dtype(dtype))
        value.update_inplace(ort_value(values, dtype))
    return caches


def decode_rate(directory: Path, provider: str, batch: int, ctx: int, steps: int, cuda_graph: bool,
                warmup: int = 5) -> dict:
    from mla_deploy.inspection import inspect_path
    from mla_deploy.runtime.cache import DecodeBinding

    model = _model(directory, provider)
    cfg = model.config
    if ctx + warmup + steps > model.max_seq_len:
        return {"skipped": f"context {ctx} + {warmup + steps} steps exceeds the export's {model.max_seq_len}"}
    session = _session(model, cuda_graph) if cuda_graph else model.sessions[io_spec.DECODE]
    rng = np.random.default_rng(ctx)
    caches = _filled_caches(model, batch, ctx + warmup + steps, rng)
    d = DecodeBinding(session, caches, batch, cfg.vocab_size)
    times = []
    for i in range(warmup + steps):
        d.ids[:, 0] = rng.integers(0, cfg.vocab_size, batch)
        d.pos[:, 0] = d.write[:] = ctx + i
        t0 = time.perf_counter()
        d.run(session)  # synchronous: the logits are on the host when it returns
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    if not np.isfinite(d.logits).all():
        raise FloatingPointError("non-finite logits")
    step = statistics.median(times)
    report = inspect_path(directory)
    weights = sum(report["decode_read_bytes"].values())
    per_token = model.cache_format.bytes_per_token(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    cache_read = per_token * ctx * batch
    return {"batch": batch, "context": ctx, "cuda_graph": cuda_graph, "device": model.device,
            "capacity": caches.capacity, "step_ms": round(step * 1e3, 4), "tokens_per_s": round(batch / step, 1),
            "bytes_read_per_step": int(weights + cache_read), "weight_bytes_per_step": int(weights),
            "cache_bytes_read_per_step": int(cache_read),
            "read_gb_per_s": round((weights + cache_read) / step / 1e9, 1),
            "binding_copies_per_step": d.transfer_bytes(),
            # host caches bound to a device session travel both ways every step; resident ones never
            "cache_bytes_copied_per_step": 0 if caches.resident or model.device == "cpu" else
            2 * sum(v.tensor_size_in_bytes() for v in caches.values.values())}


def scheduled_rate(directory: Path, provider: str, batch: int, prompt: int, tokens: int) -> dict:
    """`serve`'s engine without HTTP: `batch` requests of `prompt` random tokens each, `tokens` new tokens each, on one
    continuously batching Scheduler of `batch` rows; decode tokens/s over the steps in which every row decodes."""
    from mla_deploy.runtime import ExportedModel, RuntimeOptions
    from mla_deploy.runtime.scheduler import Request, Scheduler, TokenEvent

    model = ExportedModel(directory, RuntimeOptions(provider=provider, resident_caches=True))
    scheduler = Scheduler(model, max_batch=batch, prefill_chunk=prompt)
    rng = np.random.default_rng(batch)
    counts, window = [0] * batch, {}

    def emit(event, row):
        if isinstance(event, TokenEvent):
            counts[row] += 1
            if "start" not in window and min(counts) > 0:  # every row has its first token: all rows decode from here
                window.update(start=time.perf_counter(), before=sum(counts))

    for row in range(batch):
        ids = rng.integers(0, model.config.vocab_size, prompt).tolist()
        scheduler.add(Request(ids, tokens, lambda e, r=row: emit(e, r)))
    t0 = time.perf_counter()
    while scheduler.has_work():
        scheduler.step()
    end = time.perf_counter()
    decoded = sum(counts) - window["before"]
    return {"batch": batch, "prompt": prompt, "new_tokens": tokens, "device": model.device,
            "decode_tokens_per_s": round(decoded / (end - window["start"]), 1),
            "total_tokens_per_s": round(sum(counts) / (end - t0), 1),
            "rows_per_decode_step": round(scheduler.stats.decoded_rows / max(1, scheduler.stats.decode_steps), 2)}


def placement(directory: Path, provider: str, batch: int, ctx: int, steps: int = 8) -> dict:
    """onnxruntime's profiler over `steps` decode steps: nodes per provider, and the host<->device copies per step."""
    import tempfile
    from collections import Counter

    from mla_deploy.runtime.cache import DecodeBinding

    model = _model(directory, provider)
    with tempfile.TemporaryDirectory() as tmp:
        session = _session(model, False, str(Path(tmp) / "decode"))
        caches = _filled_caches(model, batch, ctx + steps, np.random.default_rng(0))
        d = DecodeBinding(session, caches, batch, model.config.vocab_size)
        for i in range(steps):
            d.ids[:, 0], d.pos[:, 0], d.write[:] = 1, ctx + i, ctx + i
            d.run(session)
        events = json.loads(Path(session.end_profiling()).read_text())
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    providers = Counter(e["args"].get("provider", "?") for e in nodes)
    copies = [e for e in nodes if "Memcpy" in e["args"].get("op_name", "")]
    on_cpu = Counter(e["args"]["op_name"] for e in nodes if e["args"].get("provider") == "CPUExecutionProvider")
    by_op = Counter()  # each op's host-side time (CUDA launches are asynchronous: the GPU's time shows where it waits)
    for e in nodes:
        by_op[e["args"].get("op_name", "?")] += e.get("dur", 0)
    return {"node_runs_per_step_by_provider": {k: v / steps for k, v in providers.items()},
            "cpu_op_runs_per_step": ({k: v / steps for k, v in on_cpu.items()} if provider != "cpu"
                                     else "all (CPU provider)"),
            "op_us_per_step": {k: round(v / steps, 1) for k, v in by_op.most_common(16)},
            "copy_nodes_per_step": len(copies) / steps,
            "copy_node_bytes_per_step": sum(int(e["args"].get("output_size", 0)) for e in copies) / steps,
            "largest_copy_node_bytes": max((int(e["args"].get("output_size", 0)) for e in copies), default=0),
            "one_layer_cache_bytes": caches.values[io_spec.past_latent(0)].tensor_size_in_bytes(),
            "binding_copies_per_step": d.transfer_bytes()}


def gpu_kernels(directory: Path, provider: str, batch: int, ctx: int, steps: int = 8, top: int = 24) -> dict:
    """The GPU's own time per decode step, kernel by kernel: torch's profiler (CUPTI, which records every kernel the
    process launches, onnxruntime's included) around `steps` steps of the decode session. The wall time of the same
    steps beside it: the difference is launches and the host. On the CPU provider there are no kernels to record."""
    import tempfile
    from collections import Counter

    import torch
    from torch.profiler import ProfilerActivity, profile

    from mla_deploy.runtime.cache import DecodeBinding

    model = _model(directory, provider)
    session = model.sessions[io_spec.DECODE]
    caches = _filled_caches(model, batch, ctx + steps + 2, np.random.default_rng(1))
    d = DecodeBinding(session, caches, batch, model.config.vocab_size)

    def step(i: int) -> None:
        d.ids[:, 0], d.pos[:, 0], d.write[:] = 1, ctx + i, ctx + i
        d.run(session)

    for i in range(2):
        step(i)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if provider == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i in range(2, 2 + steps):
            step(i)
        wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:  # the trace holds every kernel CUPTI saw, whoever launched it
        prof.export_chrome_trace(str(Path(tmp) / "trace.json"))
        events = json.loads((Path(tmp) / "trace.json").read_text()).get("traceEvents", [])
    us, count = Counter(), Counter()
    for e in events:
        if e.get("cat") == "kernel":
            us[e["name"]] += float(e.get("dur", 0))
            count[e["name"]] += 1
    return {"batch": batch, "context": ctx, "steps": steps, "wall_ms_per_step": round(wall / steps * 1e3, 4),
            "gpu_busy_ms_per_step": round(sum(us.values()) / steps / 1e3, 4),
            "kernels_per_step": sum(count.values()) / steps, "torch": torch.__version__,
            "top": [{"kernel": name[:160], "per_step": count[name] / steps, "us_per_step": round(t / steps, 1)}
                    for name, t in us.most_common(top)]}


_LOADED: dict = {}


def peer(checkpoint: Path, dry: bool, batch: int, ctx: int, steps: int, compiled: bool) -> dict:
    """transformers' own model in bfloat16 (sdpa), one decode step from exactly `ctx` cached tokens, timed."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    device = "cpu" if dry else "cuda"
    warmup = 3
    if _LOADED.get("key") != (checkpoint, device):  # one model in memory at a time, loaded once for its jobs
        warmup = 20  # a process's first point: its first steps run slow well past the first call
        _LOADED.clear()
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, attn_implementation="sdpa")
        _LOADED.update(key=(checkpoint, device), model=model.to(device).eval())
    model = _LOADED["model"]
    cfg = model.config
    if ctx + 1 > cfg.max_position_embeddings:
        return {"skipped": f"context {ctx} exceeds the checkpoint's max_position_embeddings "
                           f"{cfg.max_position_embeddings}"}
    forward = torch.compile(model, dynamic=False) if compiled else model
    g = torch.Generator(device).manual_seed(ctx)

    def fresh_cache():  # transformers 5 caches MLA's latent: [b, 1, ctx, d_c] and [b, 1, ctx, d_r] per layer
        cache = DynamicCache(config=cfg)
        for i in range(cfg.num_hidden_layers):
            latent, rope = (torch.randn(batch, 1, ctx, width, generator=g, device=device, dtype=torch.bfloat16)
                            for width in (cfg.kv_lora_rank, cfg.qk_rope_head_dim))
            cache.update(latent, rope, i)
        return cache

    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
    pos = torch.full((batch, 1), ctx, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, first = [], None
    with torch.no_grad():
        for i in range(steps + warmup):
            cache = fresh_cache()
            sync()
            t0 = time.perf_counter()
            forward(ids, position_ids=pos, past_key_values=cache, use_cache=True)
            sync()
            seconds = time.perf_counter() - t0
            first = seconds if first is None else first
            if i >= warmup:
                times.append(seconds)
    step = statistics.median(times)
    return {"model_class": type(model).__name__, "dtype": "bfloat16", "compiled": compiled, "device": device,
            "batch": batch, "context": ctx, "step_ms": round(step * 1e3, 4), "tokens_per_s": round(batch / step, 1),
            "first_call_s": round(first, 2), "load_average": [round(x, 2) for x in os.getloadavg()]}


def cuda_tests() -> dict:
    """tests/test_cuda.py's CUDA half (`-k cuda`) in a child pytest: its summary line and any failures' names."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "test_cuda.py"), "-k", "cuda"], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    lines = done.stdout.strip().splitlines()
    return {"returncode": done.returncode, "summary": lines[-1] if lines else done.stderr.strip()[-300:],
            "failed": [line.split(" ")[1] for line in lines if line.startswith("FAILED ")]}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---- summary: the goals from what is recorded ----

def summary(jobs: dict) -> dict:
    def get(key):
        value = jobs.get(key)
        return value if value and not value.get("error") and not value.get("skipped") else None

    out = {"verify": {k.split(" ", 1)[1]: ("pass" if v.get("passed") else "FAIL" if "passed" in v else "error")
                      for k, v in jobs.items() if k.startswith("verify ")}}
    bw = get("bandwidth")
    ratios = {}
    for key, value in jobs.items():
        if not key.startswith("decode ") or get(key) is None:
            continue
        _, name, rest = key.split(" ", 2)  # "decode MODEL/DTYPE/FORM batch B ctx C[ cuda-graph]"
        model = name.split("/")[0]
        if value["batch"] == 1 and bw:
            ratios.setdefault("batch1_fraction_of_copy_bandwidth", {})[f"{name} ctx {value['context']}" + (
                " cuda-graph" if value["cuda_graph"] else "")] = round(value["read_gb_per_s"] / bw["gb_per_s"], 3)
        if value["batch"] == 32:
            one = get(key.replace("batch 32", "batch 1"))  # the same export, context and CUDA-graph choice
            if one:
                point = rest.replace("batch 32 ", "") + " " + name
                ratios.setdefault("batch32_over_batch1_tokens_per_s", {})[point] = \
                    round(value["tokens_per_s"] / one["tokens_per_s"], 2)
        for flavour in ("eager", "compiled"):
            if EXPORTS.get(name.split("/")[1], {}).get("dtype") in HALF and value["batch"] in (1, 8):
                p = get(f"peer {model} {flavour} batch {value['batch']} ctx {value['context']}")
                if p:
                    ratios.setdefault(f"onnx_over_transformers_{flavour}", {})[key[len("decode "):]] = \
                        round(value["tokens_per_s"] / p["tokens_per_s"], 2)
        copies = value["cache_bytes_copied_per_step"]
        ratios.setdefault("cache_bytes_copied_per_step_by_binding", {})[key[len("decode "):]] = copies
    for key, value in jobs.items():
        if key.startswith("scheduler ") and get(key) and value["batch"] == 32:
            one = get(key.replace("batch 32", "batch 1"))
            if one:
                ratios.setdefault("scheduler_batch32_over_batch1_decode_tokens_per_s", {})[key[len("scheduler "):]] = \
                    round(value["decode_tokens_per_s"] / one["decode_tokens_per_s"], 2)
        if key.startswith("placement ") and get(key):
            copied = value["copy_node_bytes_per_step"]
            ratios.setdefault("profiled_copy_node_bytes_per_step", {})[key[len("placement "):]] = copied
    out.update(ratios)
    out["goals"] = {"verify": "pass", "batch1 half vs transformers bf16 eager / compiled": ">= 3x / >= 1.5x",
                    "batch1 fraction of copy bandwidth": ">= 0.5", "batch32 vs batch1 tokens/s": ">= 10x",
                    "per-step host<->device bytes beyond ids and sampled logits": 0}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prepare", action="store_true",
                   help="build the checkpoints and exports under --workdir and stop (no GPU or onnxruntime-gpu needed)")
    p.add_argument("--jobs", type=int, default=4, help="--prepare: exports built at a time")
    p.add_argument("--dry-run", action="store_true",
                   help="CPUExecutionProvider, the demo only, tiny sizes: the code path")
    p.add_argument("--workdir", default="/tmp/mla-gpu", help="checkpoints and exports (reused when there)")
    p.add_argument("--out", default=None,
                   help="results JSON (default benchmarks/results/gpu.json, or gpu-dry-run.json)")
    p.add_argument("--fresh", action="store_true", help="ignore the jobs already recorded in --out")
    p.add_argument("--peer-only", action="store_true",
                   help="transformers' points alone (eager, then compiled) on the first of --models, into --out")
    p.add_argument("--no-tests", action="store_true", help="leave out the run of tests/test_cuda.py")
    p.add_argument("--merge", default=None,
                   help="a --peer-only results file: waits for that process to end, then takes its peer points")
    p.add_argument("--budget-s", type=float, default=540, help="start no job after this many seconds")
    p.add_argument("--models", default="v2lite-2L,demo")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help=f"the exports measured, by name (EXPORTS), in order: {', '.join(DTYPES)}")
    p.add_argument("--forms", default=",".join(FORMS), help=f"absorb forms: {', '.join(FORMS)}")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per point (default 32; dry run 2)")
    p.add_argument("--max-seq-len", type=int, default=16512,
                   help="the exports' maximum length (>= 16k context + steps)")
    args = p.parse_args()
    args.steps = args.steps or (2 if args.dry_run else 32)
    unknown = [d for d in args.dtypes.split(",") if d not in EXPORTS]
    if unknown:
        p.error(f"--dtypes {','.join(unknown)}: expected some of {', '.join(EXPORTS)}")
    if args.prepare:
        Bench(args).prepare()
        return 0
    if args.peer_only:  # torch alone: no onnxruntime-gpu needed
        Bench(args).run_peers()
        return 0
    if args.dry_run:
        args.batches = "1,2"
        print("DRY RUN: CPUExecutionProvider, the demo at tiny sizes; its figures are not GPU figures", flush=True)
    else:
        if hasattr(ort, "preload_dlls"):  # CUDA and cuDNN from the nvidia-* packages that torch installed
            try:
                ort.preload_dlls()
            except Exception as e:  # a missing library shows below as an unusable provider
                print(f"onnxruntime.preload_dlls: {e}", file=sys.stderr)
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            print(f"error: onnxruntime {ort.__version__} here has no CUDAExecutionProvider (it has: "
                  f"{', '.join(ort.get_available_providers())}). Install onnxruntime-gpu (docs/gpu.md says how on a "
                  "lent GPU machine), or run with --dry-run to check the code path on the CPU.", file=sys.stderr)
            return 2
        try:
            ort.OrtValue.ortvalue_from_shape_and_type([1], np.float32, "cuda", 0)
        except Exception as e:
            print(f"error: CUDAExecutionProvider is present but no GPU is usable: {str(e).strip().splitlines()[0]}",
                  file=sys.stderr)
            return 2
    bench = Bench(args)
    bench.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
