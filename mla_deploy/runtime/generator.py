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
from typing import Callable, Sequence

import numpy as np

from .. import io_spec
from ..errors import InputError
from .cache import CacheBuffers, DecodeBinding
from .sampling import SamplingParams, is_integer, row_generator, sample
from .session import ExportedModel
from .draft import MTPDrafter
from .history import appended
from .speculative import (PRIOR_ACCEPTANCE, DraftPolicy, Speculation, SpeculationStats, WallClock, accept_row,
                          lookup, measure_costs, shadow_acceptance, updated_acceptance, verification_pass)


@dataclass
class StepOutput:
    step: int  # 0 for the token sampled from the prefill logits
    tokens: list[int | None]  # one per row; None once a row has finished


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # the generated ids only, per row (a stop token included when it ended the row)
    finish_reasons: list[str]  # "stop" or "length"
    prefill_ms: float
    decode_ms: float  # the decode steps' wall time: graphs, sampling, proposals and acceptance
    decode_tokens: int  # tokens generated after each row's first (that one comes from the prefill)
    speculation: SpeculationStats | None = None  # draft tokens proposed and accepted, with speculation on

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0


@dataclass
class _State:
    caches: CacheBuffers
    lengths: np.ndarray  # [b] tokens held in each row's cache
    history: list[np.ndarray]  # per row: prompt + generated ids (penalties, prompt lookup, acceptance)
    rng: list[np.random.Generator]  # one a row (sampling.row_generator): its draws do not depend on its neighbours'
    history_buffers: list[np.ndarray | None]  # the buffer each row's history views (runtime.history)
    decode_binding: DecodeBinding | None = None
    drafter: MTPDrafter | None = None  # speculation by the MTP draft graph
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


def check_settings(sampling, speculation) -> None:
    """InputError where `sampling` or `speculation` is given as something else than their types (a dict, a mode's
    name): the API takes SamplingParams(temperature=0) and Speculation("lookup")."""
    for name, value, kind in (("sampling", sampling, SamplingParams), ("speculation", speculation, Speculation)):
        if value is not None and not isinstance(value, kind):
            raise InputError(f"{name}: expected a {kind.__name__} (or None), got {type(value).__name__} {value!r}")


def run_to_end(steps: Generator_[StepOutput, None, GenerationResult]) -> GenerationResult:
    """Run a generation's steps (Generator.stream, PipelineGenerator.stream) through; its GenerationResult."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class Generator:
    """Generates from an ExportedModel. Holds no per-generation state: one Generator serves many threads."""

    def __init__(self, model: ExportedModel, sampling: SamplingParams | None = None, chunk_size: int = 512,
                 stop_token_ids: Sequence[int] | None = None, speculation: Speculation | None = None,
                 proposer: Callable[[np.ndarray, int], np.ndarray] | None = None):
        """sampling and stop_token_ids default to the export's generation_config.json (model.generation), whose
        eos ids default to the model config's; speculation to off. proposer (speculation 'lookup'): a draft source
        in place of prompt lookup, called with a row's tokens so far (prompt and output, the last not yet in the
        cache) and the most drafts it may give; it returns up to that many token ids (a retrieval index, or a
        benchmark's replay of known output); acceptance checks them as any draft."""
        model.require_whole("generation")
        self.model = model
        check_settings(sampling, speculation)
        self.sampling = (model.generation.sampling if sampling is None else sampling).validate(model.config.vocab_size)
        self.speculation = (speculation or Speculation()).resolve(model)
        if self.speculation.mode == "mtp" and io_spec.PREFILL not in model.sessions:
            raise InputError(
                "speculative='mtp' reads the prompt's hidden states from the prefill graph: load the model "
                "with it (not decode only)"
            )
        if not is_integer(chunk_size) or chunk_size < 1:
            raise InputError(f"chunk_size={chunk_size!r}: must be a positive integer")
        self.chunk_size = chunk_size
        self.stop_token_ids = set(model.stop_token_ids if stop_token_ids is None
                                  else check_stop_token_ids(stop_token_ids, model.config.vocab_size))
        if not {io_spec.PREFILL, io_spec.DECODE} & set(model.sessions):
            raise InputError("a Generator runs the prefill or the decode graph: load the model with them")
        if proposer is not None and self.speculation.mode != "lookup":
            raise InputError(f"a proposer replaces prompt lookup: it needs speculative='lookup', not "
                             f"{self.speculation.mode!r}")
        spec = self.speculation
        self.proposer = proposer or (lambda history, k: lookup(history, k, spec.ngram, spec.min_ngram))

    def _proposals(self, history: np.ndarray, room: int) -> np.ndarray:
        """The proposer's drafts for a row with `history`, at most `room`: token ids in the vocabulary (a caller's
        proposer is checked as any input; prompt lookup's pass)."""
        drafts = self.proposer(history, room)
        array = np.asarray(drafts)
        if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
            raise InputError(f"proposer: expected a list of draft token ids, got {type(drafts).__name__} "
                             f"(shape {array.shape}, dtype {array.dtype})")
        outside = array[(array < 0) | (array >= self.model.config.vocab_size)]
        if outside.size:
            raise InputError(f"proposer: draft token id {outside[0]} is outside the vocabulary "
                             f"[0, {self.model.config.vocab_size})")
        return array.astype(np.int64)[:room]

    # ---- public ----
    def generate(self, prompts, max_new_tokens: int, first_allowed: np.ndarray | None = None) -> GenerationResult:
        return run_to_end(self.stream(prompts, max_new_tokens, first_allowed))

    def stream(self, prompts, max_new_tokens: int,
               first_allowed: np.ndarray | None = None
               ) -> Generator_[StepOutput, Sequence[int] | None, GenerationResult]:
        """Yield each step's new tokens; the iterator's return value is the GenerationResult.
        first_allowed [rows, vocab] bool: the tokens each row's first generated token may be (token healing's mask,
        runtime.healing); None: any.
        `send(rows)` in place of next(): those rows end at the step just yielded, finish reason "stop" (a stop string
        the consumer found in their text); the others go on.
        Closing the iterator early frees the generation's caches. With speculation a verification pass may give a row
        several tokens: they are yielded one StepOutput each, in step with the other rows (a row ahead of the others
        holds its tokens until they catch up), so the stream reads as without speculation."""
        rows = self.check_prompts(prompts, max_new_tokens)
        if max_new_tokens > 1 and io_spec.DECODE not in self.model.sessions:  # a prefill-only model gives one token
            raise InputError(f"max_new_tokens={max_new_tokens}: the tokens after the first come from the decode "
                             "graph: load the model with it")
        b = len(rows)
        first_allowed = check_first_allowed(first_allowed, b, self.model.config.vocab_size)  # before any work
        state = self.new_state([np.asarray(r, np.int64) for r in rows])
        if self.speculation.mode == "mtp":
            state.drafter = MTPDrafter(self.model, b)
        out = _Output(b, self.model.config.vocab_size if self.sampling.counts_tokens else None, self.stop_token_ids,
                      max_new_tokens)
        try:
            logits = self.prefill(state, rows)
            tokens = sample(logits, self.sampling, state.rng, state.history, out.counts, first_allowed)
            out.take(state, [[int(t)] for t in tokens])
            loop = self._speculative if self.speculation.on else self._plain
            yield from loop(state, out, tokens)
        finally:
            state.caches = None  # release the buffers even when the consumer stops early
            state.decode_binding = None
        return GenerationResult(out.generated, out.reasons, state.prefill_ms, state.decode_ms, out.decode_tokens,
                                out.stats if self.speculation.on else None)

    def _plain(self, state: _State, out: "_Output", tokens: np.ndarray):
        """One decode step per token, every row in each."""
        while True:
            yield from out.ready()
            if out.done:
                return
            t0 = time.perf_counter()
            logits = self.decode_step(state, tokens)
            tokens = sample(logits, self.sampling, state.rng, state.history, out.counts)
            out.take(state, [[int(t)] for t in tokens], decoded=True)
            state.decode_ms += (time.perf_counter() - t0) * 1e3  # the step, sampling and bookkeeping: the wall time

    def _speculative(self, state: _State, out: "_Output", tokens: np.ndarray):
        """Propose, verify, accept (runtime.speculative); a step where no row proposes is a plain decode step."""
        spec, limit, drafter = self.speculation, self.model.max_seq_len, state.drafter
        pending = tokens.copy()  # each row's last token, not yet in its cache
        b = len(pending)
        costs = measure_costs(self.model, b, spec.draft_tokens, drafter is not None)
        clock = WallClock()  # the Python around the graphs (accepting, sampling, bookkeeping): the policy weighs it too
        policy = DraftPolicy(costs, drafter is not None, clock)
        if not policy.ever_drafts(b, spec.draft_tokens):  # a pass (and its drafts) would cost more than it gives
            yield from self._plain(state, out, pending)
            return
        acceptance = np.full(b, PRIOR_ACCEPTANCE)
        for r in range(b if drafter is not None else 0):  # the first token completes the last prompt position's pair
            drafter.first_token(r, int(pending[r]))
        while True:
            yield from out.ready()
            if out.done:
                return
            t0 = time.perf_counter()  # proposing, verifying, accepting: a step's wall time
            state.lengths[out.finished] = 0  # a finished row's cache is read no more: it rides along at slot 0
            # every row writes the pass's width from its length: no draft may take another running row past the end
            end = min(limit - 1 - int(state.lengths[r]) for r in np.flatnonzero(~out.finished))
            # nor past its own token budget (the token drawn after the accepted drafts comes on top)
            rooms = [0 if out.finished[r] else max(0, min(spec.draft_tokens, out.remaining(r) - 1, end))
                     for r in range(b)]
            live = [None if out.finished[r] else acceptance[r] for r in range(b)]
            proposals = None  # prompt lookup's, before the policy cuts them: free evidence (shadow_acceptance)
            if drafter is not None:
                drafts = drafter.propose(range(b), policy.lengths(live, rooms))
            else:
                proposals = [self._proposals(state.history[r], rooms[r]) for r in range(b)]
                drafts = [d[:m] for d, m in zip(proposals, policy.lengths(live, [len(d) for d in proposals]))]
            width = max(len(d) for d in drafts)
            starts = state.lengths.copy()
            running = int((~out.finished).sum())
            t1 = time.perf_counter()  # the step past its proposals, as the scheduler's WallClock times it
            if width == 0:
                logits = self.decode_step(state, pending)
                emitted = [[int(t)] for t in sample(logits, self.sampling, state.rng, state.history, out.counts)]
                hidden = state.decode_binding.hidden
            else:
                emitted, hidden = self._verify(state, out, pending, drafts, width)
            for r, tokens_r in enumerate(emitted):
                if proposals is not None and not len(drafts[r]):
                    acceptance[r] = shadow_acceptance(acceptance[r], proposals[r], tokens_r[0])
                else:
                    acceptance[r] = updated_acceptance(acceptance[r], len(drafts[r]), len(tokens_r) - 1)
                pending[r] = tokens_r[-1]
                if (
                    drafter is not None
                ):  # the pairs just committed: (h at the pending token and each accepted draft, next)
                    drafter.commit(r, np.array(tokens_r), hidden[r, : len(tokens_r)].copy(), int(starts[r]))
            tokens_out = sum(len(t) for r, t in enumerate(emitted) if not out.finished[r])
            out.take(state, emitted, decoded=True)
            done = time.perf_counter()
            clock.observe("plain" if width == 0 else "verify", done - t1,
                          costs.decode if width == 0 else costs.verify[width + 1], tokens_out, running)
            state.decode_ms += (done - t0) * 1e3

    def _verify(self, state: _State, out: "_Output", pending: np.ndarray, drafts: list[np.ndarray],
                width: int) -> tuple[list[list[int]], np.ndarray | None]:
        """One verification pass over every row: its pending token and drafts (padded to width + 1) at its length.
        Returns each row's emitted tokens and the pass's hidden states [b, width + 1, d]; each row's length advances
        past its pending token and accepted drafts."""
        b = len(pending)
        ids = np.zeros((b, width + 1), np.int64)
        ids[:, 0] = pending
        for r, d in enumerate(drafts):
            ids[r, 1 : 1 + len(d)] = d
        if state.caches.ensure(int(state.lengths.max()) + width + 1):
            state.decode_binding = None
        logits, hidden = verification_pass(self.model, state.caches, ids, state.lengths)
        emitted = []
        for r, d in enumerate(drafts):
            counts = None if out.counts is None else out.counts[r]
            tokens = accept_row(logits[r, : len(d) + 1], d, self.sampling, state.history[r], counts, state.rng[r])
            if not out.finished[r]:
                out.stats.add(len(d), len(tokens) - 1)
            emitted.append(tokens)
        state.lengths += np.array([len(t) for t in emitted], np.int64)  # the pending token and the accepted drafts
        out.stats.verify_steps += 1
        return emitted, hidden

    def new_state(self, history: list[np.ndarray], context: int | None = None) -> _State:
        """Generation state for these rows; caches sized for the longest row (or `context` slots already held)."""
        held = max(len(h) for h in history) if context is None else context
        caches = CacheBuffers(self.model.config, len(history), min(held + 1, self.model.max_seq_len),
                              self.model.max_seq_len, self.model.device, self.model.cache_format,
                              resident=self.model.resident_caches)
        lengths = np.array([len(h) for h in history] if context is None else [context] * len(history), np.int64)
        return _State(caches, lengths, history, [row_generator(self.sampling.seed, r) for r in range(len(history))],
                      [None] * len(history))

    def check_prompts(self, prompts, max_new_tokens: int) -> list[list[int]]:
        """Token-id rows, each checked: non-empty, integer, in the vocabulary, within the export's length."""
        return check_prompts(prompts, max_new_tokens, self.model.config.vocab_size, self.model.max_seq_len)

    # ---- steps ----
    def prefill(self, state: _State, rows: list[list[int]]) -> np.ndarray:
        """Feed every prompt, chunk by chunk; returns each row's last-token logits [b, vocab]. A model loaded without
        its prefill graph (decode only: one prepacked copy of the weights) feeds the prompts through the decode
        graph."""
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
            if state.drafter is not None:
                binding.bind_output(io_spec.HIDDEN, "cpu")
            state.caches.bind(binding)
            session.run_with_iobinding(binding)
            logits = binding.get_outputs()[0].numpy()[:, 0]  # [b, 1, vocab] -> [b, vocab]
            here = (lengths - 1 >= start) & (lengths - 1 < start + t)
            last[here] = logits[here]
            if state.drafter is not None:  # the MTP draft's pairs (h_i, t_{i+1}) that the prompt holds
                hidden = binding.get_outputs()[1].numpy()  # [b, t, d]
                following = np.full((b, t), -1, np.int64)
                for r, row in enumerate(rows):
                    piece = row[start + 1 : start + t + 1]
                    following[r, : len(piece)] = piece
                state.drafter.prefill(hidden, start, following)
                for r in np.flatnonzero(here):  # the last prompt position: its pair waits for the first token
                    state.drafter.prompt_done(r, hidden[r, lengths[r] - 1 - start][None].copy(), int(lengths[r] - 1))
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
            d.run(self.model.sessions[io_spec.DECODE])
            here = lengths - 1 == p
            last[here] = d.logits[here, 0]
        state.prefill_ms += (time.perf_counter() - t0) * 1e3
        return last

    def decode_step(self, state: _State, tokens: np.ndarray) -> np.ndarray:
        """One token per row at slot lengths[b]; caches updated in place. Returns logits [b, vocab]."""
        grew = state.caches.ensure(int(state.lengths.max()) + 1)
        if state.decode_binding is None or grew:  # bound once per cache capacity; a step only writes the buffers
            state.decode_binding = DecodeBinding(self.model.sessions[io_spec.DECODE], state.caches,
                                                 state.caches.batch, self.model.config.vocab_size)
        d = state.decode_binding
        d.ids[:, 0] = tokens
        d.pos[:, 0] = state.lengths
        d.write[:] = state.lengths
        d.run(self.model.sessions[io_spec.DECODE])
        state.lengths += 1
        return d.logits[:, 0]


class _Output:
    """What a generation has emitted per row, and the rows' stops; StepOutputs are yielded from it in step."""

    def __init__(self, b: int, vocab: int | None, stop_ids: set[int], max_new_tokens: int):
        self.generated: list[list[int]] = [[] for _ in range(b)]
        self.finished = np.zeros(b, bool)
        self.reasons = ["length"] * b
        self.counts = None if vocab is None else [np.zeros(vocab, np.int32) for _ in range(b)]
        self.stop_ids, self.max_new_tokens = stop_ids, max_new_tokens
        self.decode_tokens = 0
        self.yielded = 0  # StepOutputs yielded so far
        self.stats = SpeculationStats()

    def remaining(self, r: int) -> int:
        return self.max_new_tokens - len(self.generated[r])

    def take(self, state: _State, emitted: list[list[int]], decoded: bool = False) -> None:
        """Each row's new tokens, up to its stop token or its budget (a finished row's are ignored)."""
        for r, tokens in enumerate(emitted):
            for token in tokens:
                if self.finished[r]:
                    break
                self.generated[r].append(token)
                self.decode_tokens += decoded
                state.history[r], state.history_buffers[r] = appended(state.history[r], state.history_buffers[r],
                                                                      token)
                if self.counts is not None:
                    self.counts[r][token] += 1
                if token in self.stop_ids:
                    self.finished[r], self.reasons[r] = True, "stop"
                elif len(self.generated[r]) >= self.max_new_tokens:
                    self.finished[r] = True

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def ready(self):
        """StepOutputs for every step each row has a token for (a finished row: None past its end). The consumer may
        send back rows to end at the step just yielded (end)."""
        while True:
            running = [len(g) for g, f in zip(self.generated, self.finished) if not f]
            upto = min(running) if running else max(len(g) for g in self.generated)
            if self.yielded >= upto:
                return
            step = self.yielded
            ended = yield StepOutput(step, [g[step] if step < len(g) else None for g in self.generated])
            self.yielded = step + 1
            self.end(ended or (), step)

    def end(self, rows: Sequence[int], step: int) -> None:
        """Finish these rows ("stop") at `step`, by the consumer's word (a stop string in their text): a row's tokens
        past it, drawn already where speculation ran it ahead, are dropped."""
        for r in rows:
            check_ended_row(r, len(self.generated))
            if self.finished[r] and len(self.generated[r]) <= step + 1:
                continue  # it ended there by itself
            self.decode_tokens -= len(self.generated[r]) - (step + 1)  # only the first token is not decoded
            del self.generated[r][step + 1:]
            self.finished[r], self.reasons[r] = True, "stop"


def check_ended_row(row, rows: int) -> None:
    """A row a stream's consumer sends to end (Generator.stream, PipelineGenerator.stream) is one of its `rows`."""
    if not is_integer(row) or not 0 <= row < rows:
        raise InputError(f"row {row!r} sent to end: the generation has rows 0..{rows - 1}")


def check_first_allowed(mask: np.ndarray | None, rows: int, vocab: int) -> np.ndarray | None:
    """A first-token mask as sample() takes it, [rows, vocab] bool, or InputError naming what is wrong with it."""
    if mask is None:
        return None
    mask = np.asarray(mask)
    if mask.dtype != bool or mask.shape != (rows, vocab):
        raise InputError(f"first_allowed: expected a bool mask of shape ({rows}, {vocab}), got {mask.dtype} "
                         f"{mask.shape}")
    if not mask.any(axis=1).all():
        raise InputError(f"first_allowed: row {int(np.argmin(mask.any(axis=1)))} allows no token")
    return mask


def check_prompts(prompts, max_new_tokens: int, vocab: int, limit: int, least: int = 1) -> list[list[int]]:
    """Token-id rows, each checked: non-empty, integer, in the vocabulary, within the export's length. `least`: the
    fewest new tokens allowed (the scheduler's 0: a request that only scores its prompt)."""
    if not is_integer(max_new_tokens) or max_new_tokens < least:
        raise InputError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= {least}"
                         if least != 1 else f"max_new_tokens={max_new_tokens!r}: must be a positive integer")
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist() if prompts.ndim == 2 else [prompts.tolist()]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError("prompts: expected a non-empty list of token-id lists")
    if all(is_integer(t) for t in prompts):
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
            if not is_integer(t):
                raise InputError(f"prompt {r}, position {i}: token id {t!r} is not an integer")
            if not 0 <= t < vocab:
                raise InputError(f"prompt {r}, position {i}: token id {t} is outside the vocabulary [0, {vocab})")
        if len(row) + max_new_tokens > limit:
            raise InputError(
                f"prompt {r}: {_tokens(len(row), 'prompt token')} + {_tokens(max_new_tokens, 'new token')} = "
                f"{len(row) + max_new_tokens} "
                f"exceeds the export's maximum length {limit}"
            )
        rows.append([int(t) for t in row])
    return rows


def check_stop_token_ids(stops, vocab: int) -> frozenset[int]:
    """The stop token ids a caller gives: a list (or set, tuple, 1-d array) of integers in the vocabulary."""
    if isinstance(stops, np.ndarray) and stops.ndim == 1:
        stops = stops.tolist()
    if not isinstance(stops, (list, tuple, set, frozenset)):
        raise InputError(f"stop_token_ids: expected a list of token ids, got {type(stops).__name__} {stops!r}")
    for t in stops:
        if not is_integer(t):
            raise InputError(f"stop_token_ids: {t!r} is not an integer token id")
        if not 0 <= t < vocab:
            raise InputError(f"stop_token_ids: token id {t} is outside the vocabulary [0, {vocab})")
    return frozenset(int(t) for t in stops)


def _tokens(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")
