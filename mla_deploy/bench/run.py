"""The benchmark matrix: engines x contexts x batch sizes, with the bandwidth limit measured in the same run."""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import psutil

from .. import __version__
from ..config import MLAConfig
from ..errors import MLADeployError
from ..presets import DEMO_CHECKPOINT, build_preset, checkpoint_bytes, preset_config, random_checkpoint_bytes
from . import bandwidth
from .engines import MhaOnnxEngine, OnnxEngine, TorchEngine, TransformersEngine

ALL_ENGINES = ("onnx-fused", "onnx-factored", "onnx-mha-baseline", "torch-absorbed", "torch-naive", "transformers")


@dataclass
class BenchConfig:
    preset: str | None = "v2lite-2L"
    checkpoint: Path | None = None  # overrides preset
    workdir: Path = Path("benchmarks/work")
    contexts: tuple[int, ...] = (128, 1024, 4096, 16384)
    batches: tuple[int, ...] = (1, 8)
    engines: tuple[str, ...] = ALL_ENGINES
    steps: int = 8
    prefill_tokens: int = 512
    threads: int = 2
    bandwidth_mb: int = 512  # size of the bandwidth probes (well beyond any cache)
    speculative: tuple[str, ...] = ()  # speculative decoding's modes to compare (bench.speculative): off, lookup, mtp
    draft_tokens: int = 4
    contexts_named: bool = False  # the contexts are the user's: one beyond the model's length is an error, not left out

    def __post_init__(self):
        """Bad choices fail here, before anything is built (an unknown engine was a KeyError after the builds)."""
        unknown = [e for e in self.engines if e not in ALL_ENGINES]
        if unknown or not self.engines:
            raise MLADeployError(f"--engines {','.join(self.engines)}: expected some of {', '.join(ALL_ENGINES)}")
        for flag, values in (("--contexts", self.contexts), ("--batches", self.batches)):
            if not values or min(values) < 1:
                raise MLADeployError(f"{flag} {','.join(map(str, values))}: expected integers >= 1")

    @property
    def room(self) -> int:
        """Positions a point needs past its context: the timed steps and warm-up."""
        return self.steps + 8

    def max_len(self) -> int:
        """The exports' maximum length: the longest context or prefill, and the room after it."""
        return max(*self.contexts, self.prefill_tokens) + self.room

    @classmethod
    def quick(cls, **kw) -> "BenchConfig":
        return cls(**{**dict(contexts=(128, 4096), batches=(1,), steps=4,
                             engines=("onnx-fused", "onnx-factored", "onnx-mha-baseline", "transformers")), **kw})


@dataclass
class BenchResult:
    machine: dict
    bandwidth_gbs: dict
    rows: list[dict] = field(default_factory=list)
    prefill: list[dict] = field(default_factory=list)
    runtime_start: dict = field(default_factory=dict)
    speculative: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def machine_info(threads: int) -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import onnxruntime

    return {"cpu": cpu, "logical_cores": os.cpu_count(), "threads": threads,
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "mla_deploy": __version__, "onnx_prepacked_weights": True}


def prepare(cfg: BenchConfig, progress: Callable[[str], None]) -> tuple[Path, dict[str, Path]]:
    """The checkpoint and the exports the engines need; built once in workdir and reused."""
    from ..export import ExportOptions, export
    from .mha_baseline import export_mha_baseline

    if cfg.workdir.exists() and not cfg.workdir.is_dir():
        raise MLADeployError(f"--workdir {cfg.workdir}: is a file; the benchmark builds its checkpoint and exports "
                             "in a directory")
    try:
        cfg.workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MLADeployError(f"--workdir {cfg.workdir}: cannot be created ({e.strerror or e})") from None
    checkpoint, model_cfg = model_config(cfg)
    max_len = cfg.max_len()
    outputs = {mode: cfg.workdir / f"{checkpoint.name}-export-{mode}-{max_len}" for mode in needed_exports(cfg)}
    check_disk(cfg, model_cfg, checkpoint, outputs, progress)
    if cfg.checkpoint is None:
        if not checkpoint.exists():
            progress(f"building the {cfg.preset} random-weight checkpoint (seed 0)")
        build_preset(cfg.preset, checkpoint)
    exports = {}
    for mode, out in outputs.items():
        if not (out / "manifest.json").exists():
            progress(f"exporting {mode} (max length {max_len})")
            export(checkpoint, out, ExportOptions(absorb=mode, max_seq_len=max_len, force=True), progress=progress)
        exports[mode] = out
    if "onnx-mha-baseline" in cfg.engines:
        if not (exports["fused"] / "decode_mha.onnx").exists():
            progress("exporting the decompressed-K/V baseline decode graph")
        export_mha_baseline(checkpoint, exports["fused"], max_len)
    return checkpoint, exports


def needed_exports(cfg: BenchConfig) -> list[str]:
    """The absorb forms whose exports the engines read: fused for onnx-fused and the decompressed-K/V baseline (its
    decode graph sits beside the fused export's), factored for onnx-factored and the --speculative rows."""
    wanted = {"fused": {"onnx-fused", "onnx-mha-baseline"} & set(cfg.engines),
              "factored": {"onnx-factored"} & set(cfg.engines) or cfg.speculative}
    return [mode for mode, why in wanted.items() if why]


def model_config(cfg: BenchConfig) -> tuple[Path, MLAConfig]:
    """The checkpoint the benchmark reads (given, or the preset's in the work directory) and its config."""
    if cfg.checkpoint is not None:
        return Path(cfg.checkpoint), MLAConfig.from_hf_json(Path(cfg.checkpoint) / "config.json")
    source = f"preset {cfg.preset}"
    return cfg.workdir / f"{cfg.preset}-checkpoint", MLAConfig.from_hf_dict(preset_config(cfg.preset), source=source)


def fit_contexts(cfg: BenchConfig, progress: Callable[[str], None]) -> BenchConfig:
    """`cfg` with contexts the model's length holds (max_position_embeddings, less the room each point needs): a
    default context beyond it is measured at the longest that fits, saying so; a named one is an error."""
    limit = model_config(cfg)[1].max_position_embeddings
    longest = limit - cfg.room
    why = f"the model's {limit} positions (max_position_embeddings) less {cfg.room} for the timed steps"
    if cfg.prefill_tokens > longest:
        raise MLADeployError(f"a {cfg.prefill_tokens}-token prefill does not fit {why}")
    beyond = [c for c in cfg.contexts if c > longest]
    if not beyond:
        return cfg
    if cfg.contexts_named:
        raise MLADeployError(f"--contexts {', '.join(map(str, beyond))}: beyond {why}; the longest that fits is "
                             f"{longest}")
    named = f"context{'s' if len(beyond) > 1 else ''} {', '.join(map(str, beyond))}"
    progress(f"{named} measured at {longest}, the longest that fits {why}")
    return replace(cfg, contexts=tuple(sorted({min(c, longest) for c in cfg.contexts})))


def check_disk(cfg: BenchConfig, model_cfg: MLAConfig, checkpoint: Path, outputs: dict, progress) -> None:
    """Say how much disk the checkpoint and exports still to be built take, and refuse when it is not free."""
    unit = checkpoint_bytes(model_cfg)  # one float32 copy of the weights: one export
    need = sum(unit for out in outputs.values() if not (out / "manifest.json").exists())
    if cfg.checkpoint is None and not checkpoint.exists():  # the preset's checkpoint, in its own dtype
        need += random_checkpoint_bytes(preset_config(cfg.preset), f"preset {cfg.preset}")
    if "onnx-mha-baseline" in cfg.engines and not (outputs["fused"] / "decode_mha.onnx").exists():
        need += unit
    free = shutil.disk_usage(cfg.workdir).free
    progress(f"disk: {need / 1e9:.1f} GB to build in {cfg.workdir} (reused on later runs; {free / 1e9:.1f} GB free)")
    if need > free:
        raise MLADeployError(f"{cfg.workdir}: the benchmark needs about {need / 1e9:.1f} GB of disk for its checkpoint "
                             f"and exports, {free / 1e9:.1f} GB are free; pass --workdir on a larger disk")


def make_engine(name: str, checkpoint: Path, exports: dict, threads: int):
    factories = {
        "onnx-fused": lambda: OnnxEngine(name, exports["fused"], threads),
        "onnx-factored": lambda: OnnxEngine(name, exports["factored"], threads),
        "onnx-mha-baseline": lambda: MhaOnnxEngine(name, exports["fused"], threads),
        "torch-absorbed": lambda: TorchEngine(name, checkpoint, "absorbed", threads),
        "torch-naive": lambda: TorchEngine(name, checkpoint, "naive", threads),
        "transformers": lambda: TransformersEngine(name, checkpoint, threads),
    }
    return factories[name]()


def release_memory() -> None:
    """Collect garbage and hand freed heap back to the OS, so the next engine's RSS growth is its own."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def expected_active_experts(cfg, batch: int) -> float:
    """Distinct routed experts a batch of uniformly routed rows touches: E·(1 - (1 - k/E)^b)."""
    if cfg.n_routed_experts is None:
        return 0
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def runtime_start(export_dir: Path) -> dict:
    """A fresh interpreter imports the runtime and loads a small export: seconds taken, and whether torch came in."""
    import subprocess
    import sys

    code = ("import sys, time\n"
            "t0 = time.perf_counter()\n"
            "from mla_deploy.runtime import ExportedModel\n"
            "t1 = time.perf_counter()\n"
            f"ExportedModel({str(export_dir)!r})\n"
            "t2 = time.perf_counter()\n"
            "print(t1 - t0, t2 - t1, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return {"import_s": round(float(out[0]), 3), "load_s": round(float(out[1]), 3), "torch_imported": out[2] == "True",
            "export": export_dir.name}


def _decode_points(cfg, engines, result, progress) -> None:
    """Every (batch, ctx) point for each engine in turn, so the noisy host treats them alike.
    rss_mb: resident memory the engine added: what its load added when engines share the phase,
    otherwise the growth since just before it loaded (weights, sessions, caches of that point)."""
    process = psutil.Process()
    for batch in cfg.batches:
        for ctx in cfg.contexts:
            for engine in engines:
                # a decode step holds its cache about three times over (inputs, Concat or scatter output, temporaries)
                need = 3 * batch * ctx * engine.cache_bytes_per_token()
                if need > 0.5 * psutil.virtual_memory().available:
                    result.rows.append({"engine": engine.name, "ctx": ctx, "batch": batch,
                                        "skipped": f"needs ~{need / 2**30:.1f} GB of cache buffers",
                                        "cache_bytes_per_token": engine.cache_bytes_per_token()})
                    progress(f"{engine.name}: ctx {ctx} batch {batch}: skipped, {result.rows[-1]['skipped']}")
                    continue
                ms = engine.decode_step_ms(ctx, batch, cfg.steps)
                row = {
                    "engine": engine.name,
                    "ctx": ctx,
                    "batch": batch,
                    "step_ms": float(f"{ms:.4g}"),  # 4 digits: a tiny preset's step is tens of microseconds
                    "tokens_per_s": round(batch * 1e3 / ms, 2),
                    "cache_bytes_per_token": engine.cache_bytes_per_token(),
                    "rss_mb": round(
                        (
                            getattr(engine, "rss_loaded", None)
                            if len(engines) > 1
                            else process.memory_info().rss - engine.rss_before
                        )
                        / 2**20
                    ),
                }
                weights = engine.weight_bytes_per_token(round(expected_active_experts(engine.cfg, batch)))
                if weights is not None:
                    row["bytes_per_step"] = weights + batch * ctx * engine.cache_bytes_per_token()
                result.rows.append(row)
                progress(f"{engine.name}: ctx {ctx} batch {batch}: {ms:.1f} ms/step, {row['tokens_per_s']:.1f} tok/s")


ENGINE_MODULES = {"torch-absorbed": ("torch",), "torch-naive": ("torch",), "transformers": ("torch", "transformers")}


def check_engine_modules(engines: tuple[str, ...]) -> None:
    """ModuleNotFoundError (the CLI names the extra that provides it) for a module an asked-for engine imports and
    this environment lacks: before any checkpoint or export is built and measured, not after."""
    import importlib.util

    for name in engines:
        for module in ENGINE_MODULES.get(name, ()):
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(f"engine {name} imports {module}", name=module)


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] = lambda m: None) -> BenchResult:
    t0 = time.perf_counter()
    check_engine_modules(cfg.engines)
    cfg = fit_contexts(cfg, progress)
    checkpoint, exports = prepare(cfg, progress)
    progress("measuring memory bandwidth")
    bw = {"matmul_start": max(bandwidth.matmul_read_gbs(cfg.threads, cfg.bandwidth_mb, k=k) for k in (2048, 4096)),
          "numpy_threads": bandwidth.numpy_read_gbs(cfg.bandwidth_mb, threads=cfg.threads)}
    result = BenchResult(machine_info(cfg.threads), bw)
    # the absorbed exports take turns at every point; the rest (the decompressed-K/V baseline needs GBs of
    # cache at 16k x batch 8, the torch engines are slow) run one at a time, each alone in memory
    onnx_names = [n for n in cfg.engines if n in ("onnx-fused", "onnx-factored")]
    other_names = [n for n in cfg.engines if n not in onnx_names]
    if cfg.prefill_tokens:  # prefill: one engine at a time (full sessions)
        for name in cfg.engines:
            engine = make_engine(name, checkpoint, exports, cfg.threads)
            if not engine.has_prefill:
                continue
            engine.load(graphs=("prefill",))
            pf = engine.prefill_tokens_per_s(cfg.prefill_tokens)
            if pf is not None:
                result.prefill.append({"engine": name, "tokens": cfg.prefill_tokens, "tokens_per_s": round(pf, 1)})
                progress(f"{name}: prefill {cfg.prefill_tokens} tokens at {pf:.0f} tok/s")
            engine.close()
    # decode, the absorbed ONNX engines side by side: both loaded (decode graphs only), measured in turn
    process = psutil.Process()
    engines = []
    for name in onnx_names:
        progress(f"{name}: loading decode graph")
        engine = make_engine(name, checkpoint, exports, cfg.threads)
        release_memory()
        engine.rss_before = process.memory_info().rss
        engine.load(graphs=("decode",))
        engine.rss_loaded = process.memory_info().rss - engine.rss_before  # its own weights and sessions
        engines.append(engine)
    _decode_points(cfg, engines, result, progress)
    for engine in engines:
        engine.close()
    engines.clear()
    for name in other_names:
        release_memory()
        progress(f"{name}: loading")
        engine = make_engine(name, checkpoint, exports, cfg.threads)
        engine.rss_before = process.memory_info().rss
        engine.load()
        _decode_points(cfg, [engine], result, progress)
        engine.close()
    if cfg.speculative:  # greedy generations per mode over the factored export, interleaved (bench.speculative)
        from .speculative import speculative_rows

        modes = ("off",) + tuple(m for m in cfg.speculative if m != "off")
        result.speculative = speculative_rows(exports["factored"], modes, cfg.threads, draft_tokens=cfg.draft_tokens,
                                              progress=progress)
    small = cfg.workdir / "demo-export"
    if not (small / "manifest.json").exists():
        from ..export import ExportOptions, export

        export(DEMO_CHECKPOINT, small, ExportOptions(force=True))
    result.runtime_start = runtime_start(small)
    progress(f"runtime start: {result.runtime_start}")
    bw["matmul_end"] = max(bandwidth.matmul_read_gbs(cfg.threads, cfg.bandwidth_mb, k=k) for k in (2048, 4096))
    # the limit uses the highest bandwidth seen in the run (the conservative choice for the fraction)
    for row in result.rows:
        if "bytes_per_step" in row and "step_ms" in row:
            row["limit_step_ms"] = round(row["bytes_per_step"] / (max(bw.values()) * 1e9) * 1e3, 3)
            row["fraction_of_limit"] = round(row["limit_step_ms"] / row["step_ms"], 3)
    result.seconds = round(time.perf_counter() - t0, 1)
    return result
