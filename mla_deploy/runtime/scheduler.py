"""Continuous batching over one batched latent cache: plain Python over the runtime, no HTTP, no threads.

The scheduler owns `max_batch` cache rows (one CacheBuffers of [max_batch, capacity, width] per layer)
and the two sessions. Each `step()`:
  1. drops cancelled requests (a client gone frees its row here, within one step);
  2. admits queued requests into free rows (lowest row first, so the occupied rows stay a prefix);
  3. prefills admitted prompts chunk by chunk, at most `prefill_budget` tokens per step, so a long
     prompt is spread over several steps while the running streams keep decoding between them;
     every chunk is a batch-1 prefill into that row's slice of the cache, `prefill_chunk` tokens from
     a fixed boundary, so a prompt's numbers do not depend on what else is running;
  4. decodes one token for every running row in one decode call over rows [0, hi), where hi is one past
     the highest occupied row. A row that is not decoding (free, or still prefilling) rides along with a
     pad token written at its own length: its next prefill chunk or first decode overwrites that slot
     before any query can see it (attention is causal on slots, as in the Generator).
Rows share the cache capacity, which grows by CacheBuffers.BLOCK slots to the longest row's need and
never past the export's maximum length; a request that could not fit is refused when submitted.

Each request carries its own SamplingParams and random generator (its seed), stop ids and token budget.
Events go to the request's `emit` callback from inside `step()`: TokenEvent per token, then Finished.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from .. import io_spec
from ..errors import InputError, MLADeployError
from .cache import CacheBuffers, DecodeBinding
from .generator import check_prompts
from .sampling import SamplingParams, sample
from .session import ExportedModel


class QueueFull(MLADeployError):
    """More requests are waiting than the scheduler's max_queue: try again later."""


@dataclass
class TokenEvent:
    token: int
    logprob: float | None = None  # log-probability of `token` under the model (when logprobs were asked for)
    top_logprobs: list[tuple[int, float]] | None = None  # the k likeliest tokens and their log-probabilities


@dataclass
class Finished:
    reason: str  # "stop" (a stop id), "length" (max_new_tokens), "cancelled"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    emit: Callable[[TokenEvent | Finished], None]
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int = 0  # top log-probabilities per token; 0: none
    id: int = field(default_factory=itertools.count().__next__)
    # scheduler state
    row: int | None = None
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # the last sampled token, not yet in the cache
    history: np.ndarray | None = None
    rng: np.random.Generator | None = None
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.perf_counter)


@dataclass
class SchedulerStats:
    steps: int = 0
    decode_steps: int = 0
    decoded_rows: int = 0  # sum over decode steps of the rows that produced a token (batch occupancy)
    prefill_tokens: int = 0
    generated_tokens: int = 0
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "cancelled": 0})


class Scheduler:
    def __init__(self, model: ExportedModel, max_batch: int = 16, max_queue: int = 256, prefill_chunk: int = 256,
                 prefill_budget: int | None = None):
        if model.device != "cpu":
            raise InputError("the scheduler runs on the CPU provider only (its cache rows are numpy views)")
        if io_spec.PREFILL not in model.sessions:
            raise InputError("the scheduler prefills prompts with the prefill graph: load the model with both graphs")
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name}={value!r}: must be a positive integer")
        self.model, self.max_batch, self.max_queue, self.prefill_chunk = model, max_batch, max_queue, prefill_chunk
        self.prefill_budget = prefill_chunk if prefill_budget is None else prefill_budget
        if self.prefill_budget < 1:
            raise InputError(f"prefill_budget={prefill_budget!r}: must be a positive integer")
        self.caches = CacheBuffers(model.config, max_batch, 1, model.max_seq_len, "cpu", model.cache_dtype)
        self.lengths = np.zeros(max_batch, np.int64)  # tokens held in each row's cache
        self.rows: list[Request | None] = [None] * max_batch
        self.waiting: deque[Request] = deque()
        self.stats = SchedulerStats()
        self._decode: DecodeBinding | None = None

    # ---- requests ----
    def check(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """The prompt as ints, or InputError naming what is wrong (vocabulary, length limit): the Generator's check."""
        return check_prompts([prompt_ids], max_new_tokens, self.model.config.vocab_size, self.model.max_seq_len)[0]

    def add(self, request: Request) -> None:
        """Check a request and queue it; QueueFull beyond max_queue."""
        request.prompt_ids = self.check(request.prompt_ids, request.max_new_tokens)
        request.sampling.validate()
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue {self.max_queue})")
        self.enqueue(request)

    def enqueue(self, request: Request) -> None:
        """Queue a request already checked (an Engine checks on the submitting thread and bounds the queue itself)."""
        request.history = np.asarray(request.prompt_ids, np.int64)
        request.rng = np.random.default_rng(request.sampling.seed)
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Mark a request cancelled; the next step frees its row (or drops it from the queue)."""
        request.cancelled = True

    @property
    def running(self) -> list[Request]:
        return [r for r in self.rows if r is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.rows)

    # ---- the step ----
    def step(self, after_phase: Callable[[], None] = lambda: None) -> None:
        """One scheduling step; `after_phase()` runs after the prefills and after the decode (an Engine hands the
        events of each phase over to its event loops there, so a first token does not wait for the decode)."""
        self.stats.steps += 1
        self._drop_cancelled()
        self._admit()
        self._prefill()
        after_phase()
        decoding = [r for r in self.rows if r is not None and r.pending is not None]
        if decoding:
            self._decode_step(decoding)
        after_phase()

    def _drop_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self._finish(request, "cancelled")
        for request in self.running:
            if request.cancelled:
                self._finish(request, "cancelled")

    def _admit(self) -> None:
        while self.waiting and None in self.rows:
            request = self.waiting.popleft()
            row = self.rows.index(None)
            self.rows[row], request.row = request, row
            self.lengths[row] = 0

    def _prefill(self) -> None:
        budget = self.prefill_budget
        for request in [r for r in self.rows if r is not None and r.pending is None]:
            while request.prefilled < len(request.prompt_ids) and budget > 0:
                # a chunk always starts at a multiple of prefill_chunk: a prompt's chunks do not depend on the load
                t = min(self.prefill_chunk, len(request.prompt_ids) - request.prefilled)
                self._prefill_chunk(request, t)
                budget -= t
            if budget <= 0:
                break

    def _prefill_chunk(self, request: Request, t: int) -> None:
        start, row = request.prefilled, request.row
        if self.caches.ensure(start + t):
            self._decode = None
        session = self.model.sessions[io_spec.PREFILL]
        ids = np.asarray(request.prompt_ids[start:start + t], np.int64)[None]  # [1, t]
        binding = session.io_binding()
        binding.bind_cpu_input(io_spec.INPUT_IDS, ids)
        binding.bind_cpu_input(io_spec.POSITION_IDS, np.arange(start, start + t, dtype=np.int64)[None])  # [1, t]
        binding.bind_cpu_input(io_spec.ATTENTION_MASK, np.ones((1, self.caches.capacity), np.int64))
        binding.bind_cpu_input(io_spec.WRITE_INDICES, np.array([start], np.int64))
        binding.bind_cpu_input(io_spec.LOGITS_POSITIONS, np.array([[t - 1]], np.int64))
        binding.bind_output(io_spec.LOGITS, "cpu")
        views = self.caches.bind(binding, slice(row, row + 1))  # in place, this row's slice only
        session.run_with_iobinding(binding)
        del views
        request.prefilled += t
        self.lengths[row] = request.prefilled
        self.stats.prefill_tokens += t
        if request.prefilled == len(request.prompt_ids):
            logits = binding.get_outputs()[0].numpy()[:, 0]  # [1, 1, vocab] -> [1, vocab]
            self._sample_and_emit(request, logits)

    def _decode_step(self, decoding: list[Request]) -> None:
        hi = max(r.row for r in decoding) + 1
        if self.caches.ensure(int(self.lengths[:hi].max()) + 1) or self._decode is None or self._decode.rows != hi:
            self._decode = DecodeBinding(self.model.sessions[io_spec.DECODE], self.caches, hi,
                                         self.model.config.vocab_size)
        d = self._decode
        d.ids[:] = 0  # pad rows
        for r in decoding:
            d.ids[r.row, 0] = r.pending
        d.pos[:, 0] = self.lengths[:hi]
        d.write[:] = self.lengths[:hi]
        self.model.sessions[io_spec.DECODE].run_with_iobinding(d.binding)
        for r in decoding:
            self.lengths[r.row] += 1
        self.stats.decode_steps += 1
        self.stats.decoded_rows += len(decoding)
        plain = [r for r in decoding if _plain_greedy(r.sampling)]  # one argmax for all of them
        chosen = dict(zip((r.id for r in plain), d.logits[[r.row for r in plain], 0].argmax(-1).tolist()))
        alike: dict[SamplingParams, list[Request]] = {}  # the other rows by their sampling, seeds aside
        for r in decoding:
            if r.id not in chosen:
                alike.setdefault(replace(r.sampling, seed=None), []).append(r)
        for params, rows in alike.items():  # one sample() per setting; each row draws from its own generator
            tokens = sample(d.logits[[r.row for r in rows], 0], params, [r.rng for r in rows], [r.history for r in rows])
            chosen.update(zip((r.id for r in rows), tokens.tolist()))
        for r in decoding:
            self._sample_and_emit(r, d.logits[r.row : r.row + 1, 0], chosen[r.id])

    def _sample_and_emit(self, request: Request, logits: np.ndarray, token: int | None = None) -> None:
        """logits [1, vocab]: sample this request's next token (unless already chosen), emit it, and finish the
        request if it stops."""
        if token is None:
            token = int(sample(logits, request.sampling, request.rng, [request.history])[0])
        request.generated.append(token)
        if request.sampling.repetition_penalty != 1.0:  # the only reader of the history
            request.history = np.append(request.history, token)
        self.stats.generated_tokens += 1
        event = TokenEvent(token)
        if request.logprobs:
            event.logprob, event.top_logprobs = _logprobs(logits[0], token, request.logprobs)
        request.emit(event)
        if token in request.stop_token_ids:
            self._finish(request, "stop")
        elif len(request.generated) >= request.max_new_tokens:
            self._finish(request, "length")
        else:
            request.pending = token

    def _finish(self, request: Request, reason: str) -> None:
        if request.row is not None:
            self.rows[request.row] = None
            self.lengths[request.row] = 0
            request.row = None
        request.pending = None
        self.stats.finished[reason] += 1
        request.emit(Finished(reason, len(request.prompt_ids), len(request.generated)))


def _plain_greedy(params: SamplingParams) -> bool:
    """Greedy without a repetition penalty: the argmax of the logits, the same for every such row."""
    return params.greedy and params.repetition_penalty == 1.0


def _logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    z = logits.astype(np.float64)
    logp = z - z.max() - np.log(np.exp(z - z.max()).sum())  # log-softmax [vocab]
    top = np.argsort(-logp, kind="stable")[:k]
    return float(logp[token]), [(int(i), float(logp[i])) for i in top]
