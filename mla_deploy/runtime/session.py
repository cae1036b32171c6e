"""Loading an export: manifest checks, onnxruntime sessions, providers. onnxruntime + numpy only."""

from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .. import integrity, io_spec, kernels
from ..config import MLAConfig
from ..errors import ExportLoadError, InputError, MLADeployError, ProviderError
from ..manifest import WEIGHTS_FILE, cache_format, check_files, is_staged, read_manifest, require_whole, stage_of
from .chat import GenerationDefaults
from .dtypes import ort_value
from .feeds import check_feed
from .memory import ResidentMemory, resident_memory
from .populate import fits_in_memory, mappings, populate
from .sampling import is_integer

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def resolve_providers(provider: str, fallback: bool = True) -> list[str]:
    """'cpu' or 'cuda' -> onnxruntime provider list. Missing CUDA falls back to CPU with a warning (ExportedModel.device
    names the one in use), or with `fallback` False is a ProviderError."""
    if provider not in PROVIDERS:
        raise ProviderError(f"unknown provider {provider!r}; expected one of {', '.join(PROVIDERS)}")
    available = ort.get_available_providers()
    wanted = PROVIDERS[provider]
    if wanted in available:
        return [wanted] + (["CPUExecutionProvider"] if wanted != "CPUExecutionProvider" else [])
    message = (f"provider {provider!r} ({wanted}) is not available in this onnxruntime build "
               f"(it has: {', '.join(available)}); install onnxruntime-gpu for CUDA")
    if not fallback:
        raise ProviderError(message)
    warnings.warn(message + "; falling back to CPU", RuntimeWarning, stacklevel=3)
    return ["CPUExecutionProvider"]


def provider_options(providers: list[str], cuda_graph: bool = False) -> list[dict[str, str]]:
    """onnxruntime's options for each of `providers`. CUDA computes float32 as float32: TF32 (on by default there)
    keeps 10 mantissa bits of a MatMul's inputs, far outside a float32 export's verify tolerance. `cuda_graph`:
    replay the session's kernels as one CUDA graph, for a session whose every input and output is bound at a fixed
    device address (runtime.cache.DecodeBinding over resident caches of a fixed capacity)."""
    cuda = {"use_tf32": "0", **({"enable_cuda_graph": "1"} if cuda_graph else {})}
    return [cuda if name == PROVIDERS["cuda"] else {} for name in providers]


@dataclass
class RuntimeOptions:
    provider: str = "cpu"
    threads: int = 0  # 0: onnxruntime's default (one per physical core)
    log_severity: int = 3  # onnxruntime's own log: 0 verbose .. 3 errors only
    check_weights: str = "sampled"  # "full": hash every block of weights.bin at load (mla_deploy.integrity)
    # onnxruntime's prepacking copies every MatMul weight into a per-session packed buffer. None (auto): off, so both
    # sessions read the one memory-mapped weights.bin (docs/benchmarks.md, "One copy of the weights"; mla-deploy's own
    # ops never prepack), except for an export whose graphs use onnxruntime's MatMulNBits or QMoE, which run ~60x slower
    # unpacked (they dequantize on every call).
    prepack: bool | None = None
    # onnxruntime's intra-op threads spin between ops waiting for work: fastest for one caller, but in a server they
    # take the cores the HTTP event loop needs (docs/serving.md). serve turns it off. Spinning stops at the end of
    # each run either way (session.force_spinning_stop): an idle prefill session's workers spinning on took a core
    # from the next decode steps (docs/benchmarks.md).
    spin: bool = True
    # further onnxruntime session config entries as (key, value) pairs, applied after the ones above (so they win),
    # e.g. ("session.set_denormal_as_zero", "1"); onnxruntime ignores keys it does not know
    session_config: tuple[tuple[str, str], ...] = ()
    # mla-deploy's own custom-op library (mla_deploy.kernels), registered on every CPU session where it was built;
    # off, the graphs run those ops' ONNX function bodies (a half export then reads float32 copies of its weights)
    kernels: bool = True
    # caches in onnxruntime's own allocations on the session's device, bound by address (runtime.cache.CacheBuffers).
    # None: on every device but the CPU, so a CUDA step moves no cache through the host. On the CPU it runs the very
    # code path a device takes, which is how CI tests it.
    resident_caches: bool | None = None
    # every page of weights.bin mapped at load (runtime.populate: llama.cpp's MAP_POPULATE), so that steps do not take
    # page faults on weights no step read before. None: on the CPU where the file fits in the memory available
    populate: bool | None = None

    def validate(self) -> None:
        """An InputError naming the first field that onnxruntime would refuse obscurely, or read wrongly (a string
        "false" is true to Python), before any session is made."""
        if not (is_integer(self.threads) and self.threads >= 0):
            raise InputError(f"threads={self.threads!r}: expected an integer >= 0 (0: one per physical core)")
        if not (is_integer(self.log_severity) and 0 <= self.log_severity <= 4):
            raise InputError(f"log_severity={self.log_severity!r}: expected an integer from 0 (verbose) to 4 (fatal)")
        if self.check_weights not in integrity.CHECKS:
            raise InputError(f"check_weights={self.check_weights!r}: expected one of {', '.join(integrity.CHECKS)}")
        for name in ("spin", "kernels"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}={getattr(self, name)!r}: expected True or False")
        for name in ("prepack", "resident_caches", "populate"):
            if not isinstance(getattr(self, name), bool | None):
                raise InputError(f"{name}={getattr(self, name)!r}: expected True, False or None (auto)")
        for entry in self.session_config:
            if not (isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(x, str) and x for x in entry)):
                raise InputError(f"session_config entry {entry!r}: expected a (key, value) pair of non-empty strings")
            if not entry[0].startswith(SESSION_CONFIG_AREAS):  # onnxruntime takes any key and ignores unknown ones
                raise InputError(f"session_config key {entry[0]!r}: not an onnxruntime session option; their keys "
                                 f"begin with {', '.join(SESSION_CONFIG_AREAS)}")


SESSION_CONFIG_AREAS = ("session.", "optimization.", "mlas.", "ep.")  # the areas of onnxruntime's config keys
THREADS_PER_CPU = 4  # the most intra-op threads per logical CPU a session is given (more only time-slice them)


def check_threads(threads: int) -> None:
    """An InputError where `threads` is past THREADS_PER_CPU x this machine's logical CPUs: onnxruntime creates every
    one (100000 took minutes and 11 GB, unkillable by SIGTERM). Checked where the sessions are made, so a Ray stage
    weighs its own node's CPUs."""
    cpus = os.cpu_count() or 1
    if threads > THREADS_PER_CPU * cpus:
        raise InputError(f"threads={threads}: more than {THREADS_PER_CPU} per logical CPU of this machine's {cpus}; "
                         "0 takes one per physical core")


PREPACKED_OPS = ("com.microsoft::MatMulNBits", "com.microsoft::QMoE")  # slow unless onnxruntime prepacks them


def needs_prepacking(manifest: dict) -> bool:
    """Whether an export's graphs use an op that onnxruntime must prepack to be fast (RuntimeOptions.prepack's auto):
    from the manifest's operator counts, or, for a manifest without them, whether it is quantized."""
    counts = [graph.get("op_counts") for graph in manifest["graphs"].values()]
    if any(c is None for c in counts):
        return bool(manifest.get("quantization"))
    return any(op in c for c in counts for op in PREPACKED_OPS)


class ExportedModel:
    """An export directory, checked, with a prefill and a decode session; speculative decoding loads the verify and
    draft sessions when it is first asked for (`load`). Safe to share across threads.

    One stage's directory of a staged export (export --stages N) loads here like any export, its graphs taking and
    returning hidden states (io_spec); the staged export's own directory runs through runtime.chain (in this process)
    or runtime.stages (one Ray actor per stage)."""

    def __init__(self, directory: str | Path, options: RuntimeOptions | None = None,
                 graphs: tuple[str, ...] = (io_spec.PREFILL, io_spec.DECODE)):
        """`graphs` limits the sessions created (a decode-only model for benchmarks holds half the memory)."""
        self._loading = threading.Lock()
        self.directory = Path(directory)
        if options is not None and not isinstance(options, RuntimeOptions):
            raise InputError(f"options: expected a RuntimeOptions (or None), got {type(options).__name__} {options!r}")
        self.options = options or RuntimeOptions()
        self.options.validate()
        check_threads(self.options.threads)
        self.manifest = read_manifest(self.directory)
        if is_staged(self.manifest):
            raise ExportLoadError(f"{self.directory}: a staged export of {len(self.manifest['stages'])} stages; run it "
                                  "with runtime.stages.StagedModel (one Ray actor per stage: the 'ray' extra) or "
                                  "runtime.chain.StageChain (every stage in this process), or load one of its stage "
                                  "directories")
        if isinstance(graphs, str) or not all(g in self.manifest["graphs"] for g in graphs):
            raise InputError(f"graphs={graphs!r}: expected a tuple of this export's graphs "
                             f"({', '.join(self.manifest['graphs'])})")
        check_files(self.directory, self.manifest, self.options.check_weights)
        self.config: MLAConfig = self.manifest["config_obj"]
        self.stage: io_spec.Stage = stage_of(self.manifest) or io_spec.Stage.whole(self.config.num_hidden_layers)
        self.max_seq_len: int = int(self.manifest["max_seq_len"])
        # the caches' element types (io_spec.CacheFormat, runtime.dtypes), as the manifest's precision records them;
        # cache_dtype is the latent's; logits are always float32
        self.cache_format: io_spec.CacheFormat = cache_format(self.manifest)
        self.cache_dtype: str = self.cache_format.latent
        self.providers = resolve_providers(self.options.provider)
        self.device = "cuda" if self.providers[0] == PROVIDERS["cuda"] else "cpu"
        resident = self.options.resident_caches
        self.resident_caches = self.device != "cpu" if resident is None else resident
        self.generation = GenerationDefaults.from_export(self.directory)  # generation_config.json's defaults
        self.stop_token_ids: tuple[int, ...] = self.generation.eos_token_ids or tuple(self.config.eos_token_id)
        self.prepack = needs_prepacking(self.manifest) if self.options.prepack is None else self.options.prepack
        started = time.perf_counter()
        self.sessions = {kind: self._session(kind) for kind in graphs}
        self.populated_bytes = self._populate()
        self.load_seconds = time.perf_counter() - started
        self.load_memory: ResidentMemory | None = resident_memory()  # this process, just after the sessions loaded

    @property
    def has_draft(self) -> bool:
        """Whether the export has the MTP draft graph (speculative decoding's 'mtp' mode)."""
        return io_spec.DRAFT in self.manifest["graphs"]

    def has_graph(self, kind: str) -> bool:
        return kind in self.manifest["graphs"]

    def load(self, *kinds: str) -> None:
        """Create the sessions of these graphs where not loaded yet (a quantized export's prepacked weights cost memory
        per session, so the verify and draft graphs load only for speculative decoding)."""
        with self._loading:
            for kind in kinds:
                if kind not in self.sessions:
                    if not self.has_graph(kind):
                        raise ExportLoadError(f"{self.directory}: this export has no {kind} graph; re-export the "
                                              "checkpoint with this mla-deploy")
                    mapped = frozenset(mappings(self.directory / WEIGHTS_FILE))  # the loaded sessions', populated
                    self.sessions = {**self.sessions, kind: self._session(kind)}  # readers see the old or the new dict
                    self.populated_bytes += self._populate(skip=mapped)

    def require_whole(self, what: str) -> None:
        """manifest.require_whole for this export: `what` refuses a stage of a staged export."""
        require_whole(self.directory, self.manifest, what)

    def run(self, kind: str, feed: dict) -> dict:
        """One checked call of a graph (prefill, decode, verify, draft); outputs by name (new arrays, the feed left
        unchanged). Bound through IO binding, so bfloat16 caches (uint16 bit patterns here: runtime.dtypes) pass both
        ways."""
        if kind not in self.sessions:
            raise ValueError(f"graph {kind!r}: this model has loaded {', '.join(map(repr, self.sessions))}")
        check_feed(kind, feed, self.config, self.max_seq_len, self.cache_format, self.stage)
        session = self.sessions[kind]
        inputs, outputs = self.graph_io(kind)
        new = feed[io_spec.INPUT_IDS if self.stage.first else io_spec.HIDDEN_STATES]  # [b, T] or [b, T, d]
        n = feed[io_spec.LOGITS_POSITIONS].shape[1] if io_spec.LOGITS_POSITIONS in feed else new.shape[1]
        b, t, d = new.shape[0], new.shape[1], self.config.hidden_size
        results = {io_spec.LOGITS: np.empty((b, n, self.config.vocab_size), np.float32),
                   io_spec.HIDDEN: np.empty((b, t if kind != io_spec.DRAFT else n, d), np.float32),
                   io_spec.HIDDEN_STATES_OUT: np.empty((b, t, d), np.float32)}  # a stage's but the last
        for spec in outputs:
            if spec.name not in results:
                results[spec.name] = np.empty_like(feed[io_spec.past_of(spec.name)])
        binding, held = session.io_binding(), []
        for spec in inputs:
            held.append(ort_value(np.ascontiguousarray(feed[spec.name]), spec.dtype))
            binding.bind_ortvalue_input(spec.name, held[-1])
        given = {o.name for o in session.get_outputs()}
        for spec in outputs:
            if spec.name in given:
                held.append(ort_value(results[spec.name], spec.dtype))
                binding.bind_ortvalue_output(spec.name, held[-1])
        session.run_with_iobinding(binding)
        return {name: value for name, value in results.items() if name in given}

    def graph_io(self, kind: str) -> tuple[list[io_spec.TensorSpec], list[io_spec.TensorSpec]]:
        """The inputs and outputs of this export's (or this stage's) `kind` graph."""
        return io_spec.graph_io(kind, self.config, self.cache_format, hidden=self.has_draft, stage=self.stage)

    def prepacks(self, kind: str) -> bool:
        """Whether `kind`'s session prepacks its MatMul weights: RuntimeOptions.prepack where set. Auto: as `prepack`
        for prefill and decode; always for verify and draft, whose MatMuls multiply a few rows at a time, where MLAS
        packs an unpacked weight on every call (the demo's verification of 2 tokens took 4x one token's time
        unpacked, the vocabulary projection most of it), for one packed copy of the weights in that session."""
        if self.options.prepack is None and kind in (io_spec.VERIFY, io_spec.DRAFT):
            return True
        return self.prepack

    def session_options(self, kind: str = io_spec.DECODE) -> ort.SessionOptions:
        """onnxruntime's options for this model's `kind` session, from RuntimeOptions (a profiler sets its own on
        top)."""
        so = ort.SessionOptions()
        so.log_severity_level = self.options.log_severity
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = self.options.threads
        if not self.prepacks(kind):
            so.add_session_config_entry("session.disable_prepacking", "1")
        if not self.options.spin:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.force_spinning_stop", "1")
        for key, value in self.options.session_config:
            so.add_session_config_entry(key, value)
        # CPU kernels: on CUDA, onnxruntime would run them on the host between device ops; unregistered, it inlines
        # their function bodies and runs them on the device
        if self.options.kernels and self.device == "cpu" and (library := kernels.library()) is not None:
            so.register_custom_ops_library(str(library))
            kernels.warn_above_cpu()
        return so

    def _populate(self, skip: frozenset[tuple[int, int]] = frozenset()) -> int:
        """Map the sessions' pages of weights.bin now (RuntimeOptions.populate), but for the mappings in `skip`; the
        bytes mapped."""
        weights = self.directory / WEIGHTS_FILE
        wanted = self.options.populate
        if wanted is None:
            wanted = self.device == "cpu" and weights.exists() and fits_in_memory(weights.stat().st_size)
        return populate(weights, skip) if wanted else 0

    def _session(self, kind: str) -> ort.InferenceSession:
        path = self.directory / self.manifest["graphs"][kind]["file"]
        try:
            session = self._open(path, self.session_options(kind))
        except MLADeployError:  # a bad option (MLA_DEPLOY_ISA) is its own error, not the graph's
            raise
        except Exception as e:  # onnxruntime raises its own exception types for corrupt models and data
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ExportLoadError(f"{path}: onnxruntime cannot load this graph ({first})") from None
        meta = session.get_modelmeta().custom_metadata_map
        if meta.get("export_id") != self.manifest["export_id"] or meta.get("graph") != kind:
            raise ExportLoadError(
                f"{path}: graph belongs to export {meta.get('export_id')!r} ({meta.get('graph')!r}), "
                f"the manifest to {self.manifest['export_id']!r}: graphs from different exports cannot be mixed"
            )
        expected = {s["name"] for s in self.manifest["graphs"][kind]["inputs"]}
        actual = {i.name for i in session.get_inputs()}
        if expected != actual:
            raise ExportLoadError(f"{path}: graph inputs {sorted(actual ^ expected)} differ from the manifest")
        return session

    def _open(self, path: Path, options: ort.SessionOptions) -> ort.InferenceSession:
        """onnxruntime's session over the graph file `path` (verify opens the graphs changed in memory)."""
        return ort.InferenceSession(str(path), options, providers=self.providers,
                                    provider_options=provider_options(self.providers))
