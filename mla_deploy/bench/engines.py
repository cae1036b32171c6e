"""The engines a benchmark compares. Each loads, measures prefill and decode, and unloads.

Decode is measured at a context of `ctx` tokens already in the cache. Caches are filled with real
random data (never-written zero pages read at twice the real bandwidth and flatter every figure),
then `steps` decode steps are timed after one warm-up step; the median step is reported.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import numpy as np

from .. import io_spec
from ..config import MLAConfig
from ..export.absorb import AbsorbMode
from .. import footprint
from ..safetensors_io import float32_to_bf16


BUDGET_S = 20.0  # per measured point: slow engines stop early, after at least two timed steps


WARMUP_MAX = 8  # calls
WARMUP_STEADY = 0.10  # relative change between two consecutive warm-up calls that counts as steady


def _warm_up(fn) -> int:
    """Call fn until two consecutive calls differ by less than WARMUP_STEADY (the first calls after loading pay
    page faults and thread-pool start-up: 2x slow in compare_mobius.py after one call), at most WARMUP_MAX."""
    last = None
    for calls in range(1, WARMUP_MAX + 1):
        t0 = time.perf_counter()
        fn()
        now = time.perf_counter() - t0
        if last is not None and abs(now - last) <= WARMUP_STEADY * last:
            return calls
        last = now
    return WARMUP_MAX


def _median_ms(fn, steps: int) -> float:
    _warm_up(fn)
    times = []
    while len(times) < steps and (len(times) < 2 or sum(times) / 1e3 < BUDGET_S):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def random_decode_state(gen, batch: int, context: int, room: int, rng: np.random.Generator):
    """A Generator's state of `batch` rows at `context` slots, caches grown by `room` more and holding standard normal
    values in every slot, as the caches store them (bfloat16: its bit patterns, runtime.dtypes; an int8 latent: codes
    of standard normal entries and their scales): never the zero page."""
    state = gen.new_state([np.zeros(1, np.int64)] * batch, context=context)
    state.caches.ensure(context + room)
    for t in state.caches.tensors:
        arr = state.caches.arrays[t.past]
        values = rng.standard_normal(arr.shape, dtype=np.float32)
        if t.dtype == "int8":
            arr[:] = np.clip(np.round(values / (np.abs(values).max(-1, keepdims=True) / 127)), -127, 127)
        elif t.role == "scale":  # an int8 latent's: its standard normal entries' peaks / 127
            arr[:] = 3.5 / 127
        else:
            arr[:] = float32_to_bf16(values) if t.dtype == "bfloat16" else values
    return state


class OnnxEngine:
    """An mla-deploy export driven by the runtime: in-place latent caches, IO binding."""

    has_prefill = True

    def __init__(self, name: str, directory: Path, threads: int):
        self.name, self.directory, self.threads = name, directory, threads

    def load(self, graphs=("prefill", "decode")):
        from ..runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams

        # prepacked weights, as the decompressed-cache baseline's sessions have them: the fastest steps onnxruntime
        # gives, the same for every ONNX engine (`run` defaults to one mapped copy instead: docs/benchmarks.md, "One
        # copy of the weights")
        self.model = ExportedModel(self.directory, RuntimeOptions(threads=self.threads, prepack=True), graphs=graphs)
        self.cfg: MLAConfig = self.model.config
        self.gen = Generator(self.model, SamplingParams(), stop_token_ids=())
        self.absorb = AbsorbMode(self.model.manifest["absorb"])

    def prefill_tokens_per_s(self, n: int) -> float:
        """Best of two timed prefills after warming up until steady (the first prefill of n tokens after loading ran
        at ~60 % speed: v2lite-2L int4, 781 then 1255-1292 tokens/s)."""
        prompt = np.random.default_rng(0).integers(0, self.cfg.vocab_size, n).tolist()
        _warm_up(lambda: self._prefill_once(prompt))
        best = min(self._prefill_once(prompt) for _ in range(2))
        return n / best

    def _prefill_once(self, prompt) -> float:
        state = self.gen.new_state([np.asarray(prompt)])
        t0 = time.perf_counter()
        self.gen.prefill(state, [prompt])
        return time.perf_counter() - t0

    def decode_step_ms(self, ctx: int, batch: int, steps: int) -> float:
        rng = np.random.default_rng(ctx)
        state = random_decode_state(self.gen, batch, ctx, steps + 2, rng)
        tokens = rng.integers(0, self.cfg.vocab_size, batch)
        return _median_ms(lambda: self.gen.decode_step(state, tokens), steps)

    def interleaved_step_ms(self, contexts: list[int], steps: int) -> dict[int, float]:
        """The median decode step at each context, the contexts' steps taken in turn (one step at each, `steps`
        times): a ratio of two contexts' steps then sees the same machine, where blocks of steps one context after
        the other see its load change between them. Each row's context grows by one a step."""
        states = {}
        for ctx in contexts:
            rng = np.random.default_rng(ctx)
            states[ctx] = (random_decode_state(self.gen, 1, ctx, steps + WARMUP_MAX + 2, rng),
                           rng.integers(0, self.cfg.vocab_size, 1))
        for state, tokens in states.values():
            _warm_up(lambda: self.gen.decode_step(state, tokens))
        times: dict[int, list[float]] = {ctx: [] for ctx in contexts}
        for _ in range(steps):
            for ctx, (state, tokens) in states.items():
                t0 = time.perf_counter()
                self.gen.decode_step(state, tokens)
                times[ctx].append((time.perf_counter() - t0) * 1e3)
        return {ctx: statistics.median(t) for ctx, t in times.items()}

    def prefill_at_context_s(self, n: int, ctx: int) -> float:
        """Seconds to prefill `n` tokens of one row on top of `ctx` already in its cache (random data, every slot
        written), in the Generator's chunks: positions ctx .. ctx + n - 1, each chunk over the whole cache before it,
        the last token's logits out; the same cache each call (the chunks overwrite the same slots)."""
        rng = np.random.default_rng(ctx + n)
        state = random_decode_state(self.gen, 1, ctx, n, rng)
        ids = rng.integers(0, self.cfg.vocab_size, (1, n))
        session, chunk = self.model.sessions[io_spec.PREFILL], self.gen.chunk_size
        mask = np.ones((1, state.caches.capacity), np.int64)
        t0 = time.perf_counter()
        for start in range(0, n, chunk):
            t = min(chunk, n - start)
            binding = session.io_binding()
            binding.bind_cpu_input(io_spec.INPUT_IDS, np.ascontiguousarray(ids[:, start:start + t]))
            binding.bind_cpu_input(io_spec.POSITION_IDS, np.arange(ctx + start, ctx + start + t)[None])
            binding.bind_cpu_input(io_spec.ATTENTION_MASK, mask)
            binding.bind_cpu_input(io_spec.WRITE_INDICES, np.array([ctx + start], np.int64))
            binding.bind_cpu_input(io_spec.LOGITS_POSITIONS, np.array([[t - 1]], np.int64))
            binding.bind_output(io_spec.LOGITS, "cpu")
            state.caches.bind(binding)
            session.run_with_iobinding(binding)
        return time.perf_counter() - t0

    def cache_bytes_per_token(self) -> int:
        cfg = self.cfg
        return self.model.cache_format.bytes_per_token(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    def weight_bytes_per_token(self, active_experts: int) -> int:
        return sum(footprint.decode_read_bytes(self.cfg, self.absorb, active_experts=active_experts).values())

    def close(self):
        self.model = self.gen = None
        gc.collect()


class MhaOnnxEngine(OnnxEngine):
    """The decompressed-K/V baseline graph: per-head K/V caches grown by Concat each step."""

    has_prefill = False

    def load(self, graphs=None):
        import onnxruntime as ort

        from .mha_baseline import MHA_FILE
        from ..manifest import read_manifest

        self.cfg = read_manifest(self.directory)["config_obj"]
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.log_severity_level = 3
        self.session = ort.InferenceSession(str(self.directory / MHA_FILE), so, providers=["CPUExecutionProvider"])
        self.absorb = None

    def prefill_tokens_per_s(self, n: int):
        return None  # the baseline is decode-only

    def decode_step_ms(self, ctx: int, batch: int, steps: int) -> float:
        from .mha_baseline import past_key, past_value

        cfg, rng = self.cfg, np.random.default_rng(ctx)
        h = cfg.num_attention_heads
        feed = {
            io_spec.INPUT_IDS: rng.integers(0, cfg.vocab_size, (batch, 1)),
            io_spec.POSITION_IDS: np.full((batch, 1), ctx),
        }
        for i in range(cfg.num_hidden_layers):
            feed[past_key(i)] = rng.standard_normal((batch, h, ctx, cfg.qk_head_dim), dtype=np.float32)
            feed[past_value(i)] = rng.standard_normal((batch, h, ctx, cfg.v_head_dim), dtype=np.float32)
        names = [o.name for o in self.session.get_outputs()]
        # each step feeds the same past: a step's cost is what it would be at ctx (Concat copies the whole cache)
        return _median_ms(lambda: self.session.run(names, feed), steps)

    def cache_bytes_per_token(self) -> int:
        return footprint.mha_cache_bytes_per_token(self.cfg)

    def weight_bytes_per_token(self, active_experts: int) -> int:
        return sum(footprint.decode_read_bytes(self.cfg, None, active_experts=active_experts).values())

    def close(self):
        self.session = None
        gc.collect()


class TorchEngine:
    """The torch source model in the naive or the absorbed form (eager, float32)."""

    has_prefill = True

    def __init__(self, name: str, checkpoint: Path, form: str, threads: int):
        self.name, self.checkpoint, self.form, self.threads = name, checkpoint, form, threads

    def load(self, graphs=None):
        import torch

        from ..modeling import load_model

        torch.set_num_threads(self.threads)
        self.model = load_model(self.checkpoint)
        self.cfg = self.model.cfg

    def prefill_tokens_per_s(self, n: int) -> float:
        import torch

        from ..modeling import new_caches

        ids = torch.randint(0, self.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))

        def once():
            self.model(ids, torch.arange(n)[None], new_caches(self.cfg, 1, n), torch.zeros(1, dtype=torch.long),
                       torch.ones(1, n), form=self.form, logits_positions=torch.tensor([[n - 1]]))

        return n / (_median_ms(once, 1) / 1e3)

    def decode_step_ms(self, ctx: int, batch: int, steps: int) -> float:
        import torch

        from ..modeling import new_caches

        caches = new_caches(self.cfg, batch, ctx + 1)
        for c in caches:
            c.latent.normal_()
            c.rope.normal_()
        ids = torch.randint(0, self.cfg.vocab_size, (batch, 1))
        slot = torch.full((batch,), ctx)
        mask = torch.ones(batch, ctx + 1)
        return _median_ms(lambda: self.model(ids, slot[:, None], caches, slot, mask, form=self.form), steps)

    def cache_bytes_per_token(self) -> int:  # the torch source keeps its caches in float32
        cfg = self.cfg
        return io_spec.CacheFormat().bytes_per_token(cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim)

    def weight_bytes_per_token(self, active_experts: int):
        return None

    def close(self):
        self.model = None
        gc.collect()


class TransformersEngine(TorchEngine):
    """transformers' own DeepseekV2/V3ForCausalLM with its DynamicCache (sdpa attention)."""

    def __init__(self, name: str, checkpoint: Path, threads: int):
        super().__init__(name, checkpoint, "hf", threads)

    def load(self, graphs=None):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as transformers_logging

        from ..config import MLAConfig

        torch.set_num_threads(self.threads)
        self.cfg = MLAConfig.from_hf_json(Path(self.checkpoint) / "config.json")
        verbosity = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()  # its load report lists the MTP layer it does not build
        try:
            self.model = AutoModelForCausalLM.from_pretrained(
                self.checkpoint, dtype=torch.float32, attn_implementation="sdpa"
            ).eval()
        finally:
            transformers_logging.set_verbosity(verbosity)

    def prefill_tokens_per_s(self, n: int) -> float:
        import torch

        ids = torch.randint(0, self.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            return n / (_median_ms(lambda: self.model(ids, logits_to_keep=1), 1) / 1e3)

    def decode_step_ms(self, ctx: int, batch: int, steps: int) -> float:
        import torch
        from transformers import DynamicCache

        cfg = self.cfg

        def fresh_cache():
            cache = DynamicCache(config=self.model.config)
            g = torch.Generator().manual_seed(ctx)
            for i in range(
                cfg.num_hidden_layers
            ):  # transformers 5 caches the latent: [b, 1, ctx, d_c], [b, 1, ctx, d_r]
                cache.update(torch.randn(batch, 1, ctx, cfg.kv_lora_rank, generator=g),
                             torch.randn(batch, 1, ctx, cfg.qk_rope_head_dim, generator=g), i)
            return cache

        ids = torch.randint(0, cfg.vocab_size, (batch, 1))
        pos = torch.full((batch, 1), ctx)
        times = []
        for i in range(steps + 1):  # each step from exactly ctx cached tokens; the cache is built outside the timer
            cache = fresh_cache()
            t0 = time.perf_counter()
            with torch.no_grad():
                self.model(ids, position_ids=pos, past_key_values=cache, use_cache=True)
            if i:
                times.append((time.perf_counter() - t0) * 1e3)
            if len(times) >= 2 and sum(times) / 1e3 > BUDGET_S:
                break
        return statistics.median(times)
