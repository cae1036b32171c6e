"""Generation over an export: prefill, decode_step, sample, behind a Generator with a streaming iterator.

Rows of a batch may have different prompt lengths. Each row's cache is contiguous from slot 0:
prompts are right-padded inside a prefill chunk and every row writes at the same slot; a row's
pad positions land beyond its length and are overwritten by its own decode steps before any
query can see them (causality is on slots). Decode writes row b's token at slot lengths[b].
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generator as Generator_
from typing import Sequence

import numpy as np

from .. import io_spec
from ..errors import InputError
from .cache import CacheBuffers, DecodeBinding
from .sampling import SamplingParams, sample
from .session import ExportedModel


@dataclass
class StepOutput:
    step: int  # 0 for the token sampled from the prefill logits
    tokens: list[int | None]  # one per row; None once a row has finished


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # the generated ids only, per row (a stop token included when it ended the row)
    finish_reasons: list[str]  # "stop" or "length"
    prefill_ms: float
    decode_ms: float
    decode_tokens: int

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0


@dataclass
class _State:
    caches: CacheBuffers
    lengths: np.ndarray  # [b] tokens held in each row's cache
    history: list[np.ndarray]  # per row: prompt + generated ids (for the repetition penalty)
    rng: np.random.Generator
    decode_binding: DecodeBinding | None = None
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    decode_steps: int = 0


class Generator:
    """Generates from an ExportedModel. Holds no per-generation state: one Generator serves many threads."""

    def __init__(self, model: ExportedModel, sampling: SamplingParams | None = None, chunk_size: int = 512,
                 stop_token_ids: Sequence[int] | None = None):
        """sampling and stop_token_ids default to the export's generation_config.json (model.generation), whose
        eos ids default to the model config's."""
        self.model = model
        self.sampling = (model.generation.sampling if sampling is None else sampling).validate()
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise InputError(f"chunk_size={chunk_size!r}: must be a positive integer")
        self.chunk_size = chunk_size
        self.stop_token_ids = set(model.stop_token_ids if stop_token_ids is None else stop_token_ids)

    # ---- public ----
    def generate(self, prompts, max_new_tokens: int) -> GenerationResult:
        steps = self.stream(prompts, max_new_tokens)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def stream(self, prompts, max_new_tokens: int) -> Generator_[StepOutput, None, GenerationResult]:
        """Yield each step's new tokens; the iterator's return value is the GenerationResult.
        Closing the iterator early frees the generation's caches."""
        rows = self.check_prompts(prompts, max_new_tokens)
        b = len(rows)
        state = self.new_state([np.asarray(r, np.int64) for r in rows])
        generated: list[list[int]] = [[] for _ in range(b)]
        finished = np.zeros(b, bool)
        reasons = ["length"] * b
        vocab = self.model.config.vocab_size
        counts = [np.zeros(vocab, np.int32) for _ in range(b)] if self.sampling.counts_tokens else None
        try:
            logits = self.prefill(state, rows)
            for step in range(max_new_tokens):
                tokens = sample(logits, self.sampling, state.rng, state.history, counts)
                out: list[int | None] = []
                for r in range(b):
                    if finished[r]:
                        out.append(None)
                        continue
                    token = int(tokens[r])
                    generated[r].append(token)
                    state.history[r] = np.append(state.history[r], token)
                    if counts is not None:
                        counts[r][token] += 1
                    out.append(token)
                    if token in self.stop_token_ids:
                        finished[r], reasons[r] = True, "stop"
                yield StepOutput(step, out)
                if finished.all() or step == max_new_tokens - 1:
                    break
                logits = self.decode_step(state, tokens)
        finally:
            state.caches = None  # release the buffers even when the consumer stops early
            state.decode_binding = None
        return GenerationResult(generated, reasons, state.prefill_ms, state.decode_ms, state.decode_steps * b)

    def new_state(self, history: list[np.ndarray], context: int | None = None) -> _State:
        """Generation state for these rows; caches sized for the longest row (or `context` slots already held)."""
        held = max(len(h) for h in history) if context is None else context
        caches = CacheBuffers(self.model.config, len(history), min(held + 1, self.model.max_seq_len),
                              self.model.max_seq_len, self.model.device, self.model.cache_format)
        lengths = np.array([len(h) for h in history] if context is None else [context] * len(history), np.int64)
        return _State(caches, lengths, history, np.random.default_rng(self.sampling.seed))

    def check_prompts(self, prompts, max_new_tokens: int) -> list[list[int]]:
        """Token-id rows, each checked: non-empty, integer, in the vocabulary, within the export's length."""
        return check_prompts(prompts, max_new_tokens, self.model.config.vocab_size, self.model.max_seq_len)

    # ---- steps ----
    def prefill(self, state: _State, rows: list[list[int]]) -> np.ndarray:
        """Feed every prompt, chunk by chunk; returns each row's last-token logits [b, vocab]. A model loaded without
        its prefill graph (decode only: one prepacked copy of the weights) feeds the prompts through the decode graph."""
        if io_spec.PREFILL not in self.model.sessions:
            return self._prefill_by_decode(state, rows)
        t0 = time.perf_counter()
        b, longest = len(rows), max(len(r) for r in rows)
        session = self.model.sessions[io_spec.PREFILL]
        lengths = state.lengths
        last = np.zeros((b, self.model.config.vocab_size), np.float32)
        for start in range(0, longest, self.chunk_size):
            t = min(self.chunk_size, longest - start)
            ids = np.zeros((b, t), np.int64)
            for r, row in enumerate(rows):
                piece = row[start : start + t]
                ids[r, : len(piece)] = piece
            state.caches.ensure(start + t)
            binding = session.io_binding()
            binding.bind_cpu_input(io_spec.INPUT_IDS, ids)
            binding.bind_cpu_input(io_spec.POSITION_IDS, np.broadcast_to(np.arange(start, start + t), (b, t)).copy())
            binding.bind_cpu_input(io_spec.ATTENTION_MASK, np.ones((b, state.caches.capacity), np.int64))
            binding.bind_cpu_input(io_spec.WRITE_INDICES, np.full(b, start, np.int64))
            binding.bind_cpu_input(io_spec.LOGITS_POSITIONS, np.clip(lengths - 1 - start, 0, t - 1)[:, None])
            binding.bind_output(io_spec.LOGITS, "cpu")  # first output bound: get_outputs()[0]
            state.caches.bind(binding)
            session.run_with_iobinding(binding)
            logits = binding.get_outputs()[0].numpy()[:, 0]  # [b, 1, vocab] -> [b, vocab]
            here = (lengths - 1 >= start) & (lengths - 1 < start + t)
            last[here] = logits[here]
        state.prefill_ms += (time.perf_counter() - t0) * 1e3
        return last

    def _prefill_by_decode(self, state: _State, rows: list[list[int]]) -> np.ndarray:
        """The prompts one position at a time through the decode graph. A row whose prompt is done feeds its last
        token again at its last slot: the same token at the same position over the same cache writes the same
        entry, so it changes nothing while the longer rows go on."""
        t0 = time.perf_counter()
        lengths = state.lengths  # each row's prompt length (new_state)
        state.caches.ensure(int(lengths.max()))
        state.decode_binding = DecodeBinding(self.model.sessions[io_spec.DECODE], state.caches, state.caches.batch,
                                             self.model.config.vocab_size)
        d, last = state.decode_binding, np.zeros((len(rows), self.model.config.vocab_size), np.float32)
        for p in range(int(lengths.max())):
            at = np.minimum(p, lengths - 1)  # [b] each row's position this step
            d.ids[:, 0] = [row[a] for row, a in zip(rows, at)]
            d.pos[:, 0] = at
            d.write[:] = at
            self.model.sessions[io_spec.DECODE].run_with_iobinding(d.binding)
            here = lengths - 1 == p
            last[here] = d.logits[here, 0]
        state.prefill_ms += (time.perf_counter() - t0) * 1e3
        return last

    def decode_step(self, state: _State, tokens: np.ndarray) -> np.ndarray:
        """One token per row at slot lengths[b]; caches updated in place. Returns logits [b, vocab]."""
        t0 = time.perf_counter()
        grew = state.caches.ensure(int(state.lengths.max()) + 1)
        if state.decode_binding is None or grew:  # bound once per cache capacity; a step only writes the buffers
            state.decode_binding = DecodeBinding(self.model.sessions[io_spec.DECODE], state.caches,
                                                 state.caches.batch, self.model.config.vocab_size)
        d = state.decode_binding
        d.ids[:, 0] = tokens
        d.pos[:, 0] = state.lengths
        d.write[:] = state.lengths
        self.model.sessions[io_spec.DECODE].run_with_iobinding(d.binding)
        state.lengths += 1
        state.decode_ms += (time.perf_counter() - t0) * 1e3
        state.decode_steps += 1
        return d.logits[:, 0]


def check_prompts(prompts, max_new_tokens: int, vocab: int, limit: int, least: int = 1) -> list[list[int]]:
    """Token-id rows, each checked: non-empty, integer, in the vocabulary, within the export's length. `least`: the
    fewest new tokens allowed (the scheduler's 0: a request that only scores its prompt)."""
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < least:
        raise InputError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= {least}"
                         if least != 1 else f"max_new_tokens={max_new_tokens!r}: must be a positive integer")
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist() if prompts.ndim == 2 else [prompts.tolist()]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError("prompts: expected a non-empty list of token-id lists")
    if all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts):
        prompts = [prompts]  # one row given as a flat list
    rows = []
    for r, row in enumerate(prompts):
        if isinstance(row, np.ndarray):
            row = row.tolist()
        if not isinstance(row, (list, tuple)):
            raise InputError(f"prompt {r}: expected a list of token ids, got {type(row).__name__}")
        if not row:
            raise InputError(f"prompt {r}: empty; a prompt needs at least one token")
        for i, t in enumerate(row):
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
                raise InputError(f"prompt {r}, position {i}: token id {t!r} is not an integer")
            if not 0 <= t < vocab:
                raise InputError(f"prompt {r}, position {i}: token id {t} is outside the vocabulary [0, {vocab})")
        if len(row) + max_new_tokens > limit:
            raise InputError(
                f"prompt {r}: {len(row)} prompt tokens + {max_new_tokens} new tokens = {len(row) + max_new_tokens} "
                f"exceeds the export's maximum length {limit}"
            )
        rows.append([int(t) for t in row])
    return rows
