"""Continuous batching over one batched latent cache: plain Python over the runtime, no HTTP, no threads.

The scheduler owns `max_batch` cache rows (one CacheBuffers of [max_batch, capacity, width] per layer)
and the two sessions. Each `step()`:
  1. drops cancelled requests (a client gone frees its row here, within one step);
  2. admits queued requests into free rows (lowest row first, so the occupied rows stay a prefix), with prefix
     caching (runtime.prefix, the default) starting from the longest start of the prompt any row's cache holds
     (copied into the row; caches resident on a device: a free row's reused in place), the reused slots not
     prefilled again; with `cache_reuse`, also runs of a row's later tokens that the prompt continues with after
     dropping some, moved left with their keys re-rotated (runtime.prefix.moved_runs);
  3. prefills admitted prompts chunk by chunk, chunks starting while fewer than `prefill_chunk` tokens were
     prefilled this step (so about one chunk's worth a step), so a long prompt is spread over several steps
     while the running streams keep decoding between them;
     every chunk is a batch-1 prefill into that row's slice of the cache, `prefill_chunk` tokens from where the
     prompt starts (its first token, or the first past its cached slots), so a prompt's numbers do not depend on
     what else is running (nor, without prefix caching, on what ran before);
  4. decodes one token for every running row in one decode call over rows [0, hi), where hi is one past
     the highest occupied row. A row that is not decoding rides along with a pad token written at its own
     length: a prefilling row's next chunk or first decode overwrites that slot before any query can see it
     (attention is causal on slots, as in the Generator); a free row's length is the end of the slots it
     holds for prefix caching, pulled back (forgetting the last) where the pass would not fit the capacity.
Rows share the cache capacity, which grows by CacheBuffers.BLOCK slots to the longest row's need and
never past the export's maximum length; a request that could not fit is refused when submitted.

With speculation (runtime.speculative: prompt lookup or the MTP draft), step 4 is a verification pass where any
decoding row proposes tokens: every row's pending token and drafts over rows [0, hi), each row accepting its own
count and advancing its own length; a request may opt out (`speculate`), and one under a grammar does not
speculate. A step where no row proposes is the plain decode step.

Each request carries its own SamplingParams and random generator (its seed), stop ids, token budget and
optionally a grammar constraint (runtime.grammar), which masks its row's logits before sampling. Events go to
the request's `emit` callback from inside `step()`: PromptLogprobs once its prompt is prefilled (when asked
for: the prefill graph returns the logits of every prompt position, no second pass), TokenEvent per token,
then Finished. A request for 0 new tokens (prompt logprobs only) finishes after its prefill.
"""

from __future__ import annotations

import itertools
import operator
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import numpy as np

from .. import io_spec
from ..errors import GrammarError, InputError, MLADeployError
from .cache import CacheBuffers, DecodeBinding
from .generator import check_prompts, check_settings, check_stop_token_ids
from .grammar import Constraint, allowed_tokens
from .draft import MTPDrafter
from .history import appended
from .prefix import NONE, Moved, common_length, held_tokens, moved_runs, moved_tokens, reusable_slots
from .sampling import SamplingParams, is_integer, row_generator, sample, unusable_logits, unusable_rows
from .session import ExportedModel
from .speculative import (PRIOR_ACCEPTANCE, DraftPolicy, Speculation, SpeculationStats, accept_row, lookup,
                          measure_cost_model, updated_acceptance, verification_pass, WallClock)


class QueueFull(MLADeployError):
    """More requests are waiting than the scheduler's max_queue: try again later."""


@dataclass
class TokenEvent:
    token: int
    logprob: float | None = None  # log-probability of `token` under the model (when logprobs were asked for)
    top_logprobs: list[tuple[int, float]] | None = None  # the k likeliest tokens and their log-probabilities


@dataclass
class Failed:
    """The request ended by its own fault, the others running on: the model's logits for its row unusable (NaN or
    infinity: sampling.unusable_rows), or its grammar given up on while generating (GrammarError). Its last event, in
    place of Finished."""
    error: MLADeployError


@dataclass
class PromptLogprobs:
    """Each prompt token's log-probability given the tokens before it, and the k likeliest there: one entry per
    prompt position from the second on (the first has no context)."""
    entries: list[tuple[float, list[tuple[int, float]]]]


@dataclass
class Finished:
    reason: str  # "stop" (a stop id), "length" (max_new_tokens), "cancelled"
    prompt_tokens: int
    completion_tokens: int  # every token generated; for a cancelled request (a caller's stop string) that may run
    # past where the caller stopped reading, up to the step that freed its row (serve counts its own)
    cached_tokens: int = 0  # prompt tokens whose cache entries a row already held (prefix caching), not prefilled
    shifted_tokens: int = 0  # of those, the ones moved to earlier positions (cache_reuse past the common start)


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    emit: Callable[[TokenEvent | Finished], None]
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None  # log-probability of each token and the top `logprobs` beside it; None: none
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (PromptLogprobs); None: none
    constraint: Constraint | None = None  # a grammar the output must follow (response_format)
    choice: int = 0  # the i-th choice of one prompt: a seed draws its own stream for each (seed, choice)
    speculate: bool = True  # with the scheduler's speculation on: False opts this request out
    min_tokens: int = 0  # its stop ids cannot be sampled before this many tokens (vLLM's min_tokens)
    acceptance: float = PRIOR_ACCEPTANCE  # its draft tokens' acceptance, estimated (speculative.DraftPolicy)
    id: int = field(default_factory=itertools.count().__next__)
    # scheduler state
    row: int | None = None
    prefilled: int = 0
    cached: int = 0  # its first prompt tokens found in a cache row (prefix caching), not prefilled
    shifted: int = 0  # of those, the ones moved from later slots (cache_reuse)
    generated: list[int] = field(default_factory=list)
    pending: int | None = None  # the last sampled token, not yet in the cache
    history: np.ndarray | None = None  # prompt and output so far: a view of _tokens' first slots
    prompt_array: np.ndarray | None = None  # prompt_ids as an array (prefix caching compares them)
    prompt_key: int = 0  # a hash of prompt_array's bytes (a burst of one prompt is matched once per step)
    _tokens: np.ndarray | None = None  # the history's buffer (runtime.history)
    counts: np.ndarray | None = None  # [vocab] generated-token counts (presence / frequency penalties)
    prompt_lp: list | None = None  # PromptLogprobs entries gathered chunk by chunk
    rng: np.random.Generator | None = None
    cancelled: bool = False
    ended_by: str = "cancelled"  # the reason a cancelled request is finished with ("stop": a caller's stop string)
    submitted_at: float = field(default_factory=time.perf_counter)

    @property
    def stops_held(self) -> bool:
        """Its next token may not be a stop id: fewer than min_tokens generated so far."""
        return len(self.generated) < self.min_tokens and bool(self.stop_token_ids)

    def remember(self, token: int) -> None:
        """Append `token` to the history."""
        self.history, self._tokens = appended(self.history, self._tokens, token)


@dataclass
class SchedulerStats:
    steps: int = 0
    decode_steps: int = 0
    decoded_rows: int = 0  # sum over decode steps of the rows that produced a token (batch occupancy)
    prefill_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from a cache row instead of prefilled (prefix caching)
    shifted_tokens: int = 0  # of those, the ones moved to earlier slots (cache_reuse)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    finished: dict = field(default_factory=lambda: {"stop": 0, "length": 0, "cancelled": 0, "error": 0})


QUIET_STEPS = 8  # after a step where no row would draft even with every room filled, lookups rest this many steps
# tokens a free row holds past where a request starting from it diverges, worth moving to another free row before the
# request overwrites them: another chat's history behind a shared system prompt (a chat's own next turn leaves a few)
KEPT_TAIL = 16


class Scheduler:
    def __init__(self, model: ExportedModel, max_batch: int = 16, max_queue: int = 256, prefill_chunk: int = 256,
                 speculation: Speculation | None = None, prefix_caching: bool = True, cache_reuse: int = 0):
        """`prefix_caching`: a prompt starts from the cache slots a row holds for its first tokens (runtime.prefix);
        False: every prompt is prefilled whole, its numbers independent of what ran before. `cache_reuse`: with
        prefix caching, also reuse runs of at least this many of a row's later tokens that the prompt continues
        with, shifted left (runtime.prefix.moved_runs: an approximation, so 0, off, by default)."""
        model.require_whole("serving")
        if io_spec.PREFILL not in model.sessions:
            raise InputError("the scheduler prefills prompts with the prefill graph: load the model with both graphs")
        self._rows_and_queue(model, max_batch, max_queue, prefill_chunk)
        self.prefix_caching = bool(prefix_caching)
        self.caches = CacheBuffers(model.config, max_batch, 1, model.max_seq_len, model.device, model.cache_format,
                                   resident=model.resident_caches)
        self.cache_reuse = self._checked_cache_reuse(cache_reuse)
        self._decode: DecodeBinding | None = None
        self.speculation = (speculation or Speculation()).resolve(model)
        self.drafter = MTPDrafter(model, max_batch) if self.speculation.mode == "mtp" else None
        self.costs = (measure_cost_model(model, max_batch, self.speculation.draft_tokens, self.drafter is not None)
                      if self.speculation.on else None)
        # drafts that could not pay even all accepted (a draft call near a step's cost), or MTP drafts that would not
        # pay at the prior (DraftPolicy.ever_drafts): no request speculates
        self.drafts_pay = self.costs is not None and DraftPolicy(self.costs.one, self.drafter is not None).ever_drafts(
            1, self.speculation.draft_tokens)
        self.clock = WallClock()  # the Python around the steps, beyond those costs: the policy weighs it too
        self._lookups_rest_until = 0  # the step from which prompt lookup proposes again (QUIET_STEPS)

    def _rows_and_queue(self, model, max_batch: int, max_queue: int, prefill_chunk: int) -> None:
        for name, value in (("max_batch", max_batch), ("max_queue", max_queue), ("prefill_chunk", prefill_chunk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name}={value!r}: must be a positive integer")
        self.model, self.max_batch, self.max_queue, self.prefill_chunk = model, max_batch, max_queue, prefill_chunk
        self.lengths = np.zeros(max_batch, np.int64)  # tokens held in each row's cache
        self.rows: list[Request | None] = [None] * max_batch
        self.prefix_caching, self.cache_reuse = False, 0
        self.held: list[np.ndarray] = [NONE] * max_batch  # a free row's tokens in slots [0, lengths[row])
        self.held_scores: list[tuple[list, int] | None] = [None] * max_batch  # its prompt logprobs, and their k
        self.freed_at = np.zeros(max_batch, np.int64)  # when each row was last freed, in requests finished
        self.waiting: deque[Request] = deque()
        self.stats = SchedulerStats()

    def _checked_cache_reuse(self, given: int) -> int:
        try:
            least = -1 if isinstance(given, bool) else operator.index(given)
        except TypeError:
            least = -1
        if least < 0:
            raise InputError(f"cache_reuse={given!r}: must be a non-negative integer (the shortest run of cached "
                             "tokens moved; 0: off)")
        if least and not self.prefix_caching:
            raise InputError("cache_reuse: reusing cached tokens past a prompt's common start needs prefix caching")
        if least and self.caches.resident:
            raise InputError(f"cache_reuse: shifting cached keys runs on host caches, and this model's caches are "
                             f"resident on {self.model.device}; prefix caching still reuses a common start there")
        return least

    # ---- requests ----
    def check(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """The prompt as ints, or InputError naming what is wrong (vocabulary, length limit): the Generator's check,
        with 0 new tokens allowed (a request for its prompt's logprobs only)."""
        if not (isinstance(prompt_ids, (list, tuple)) or isinstance(prompt_ids, np.ndarray) and prompt_ids.ndim == 1):
            raise InputError(f"prompt_ids: expected a list of token ids, got {type(prompt_ids).__name__} "
                             f"{prompt_ids!r}"[:200])
        return check_prompts([prompt_ids], max_new_tokens, self.model.config.vocab_size, self.model.max_seq_len,
                             least=0)[0]

    def check_request(self, request: Request) -> None:
        """InputError for what the scheduler cannot run: prompt, length, sampling, logit_bias and stop ids, the
        options' types and ranges (a wrong one would fail the scheduler's step, every request's)."""
        request.prompt_ids = self.check(request.prompt_ids, request.max_new_tokens)
        check_settings(request.sampling, None)
        vocab = self.model.config.vocab_size
        request.sampling.validate(vocab)
        request.stop_token_ids = check_stop_token_ids(request.stop_token_ids, vocab)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(request, name)
            if k is not None and not (is_integer(k) and 0 <= k <= vocab):
                raise InputError(f"{name}={k!r}: must be None or an integer in [0, {vocab}] (the likeliest tokens "
                                 "given beside each token's own)")
        if not (is_integer(request.choice) and request.choice >= 0):
            raise InputError(f"choice={request.choice!r}: must be a non-negative integer")
        if not isinstance(request.speculate, bool):
            raise InputError(f"speculate={request.speculate!r}: must be True or False")
        if request.constraint is not None and not (callable(getattr(request.constraint, "consume", None))
                                                   and hasattr(request.constraint, "done")):
            raise InputError(f"constraint={request.constraint!r}: expected a grammar's Constraint "
                             "(runtime.grammar.Grammars: json_object(), json_schema(schema)) or None")
        if request.max_new_tokens == 0 and request.prompt_logprobs is None:
            raise InputError("max_new_tokens=0: only a request for its prompt's logprobs may generate nothing")
        if not isinstance(request.min_tokens, int) or not 0 <= request.min_tokens <= request.max_new_tokens:
            raise InputError(f"min_tokens={request.min_tokens!r}: must be an integer in [0, max_new_tokens "
                             f"{request.max_new_tokens}]")

    def add(self, request: Request) -> None:
        """Check a request and queue it; QueueFull beyond max_queue."""
        self.check_request(request)
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (max_queue {self.max_queue})")
        self.enqueue(request)

    def enqueue(self, request: Request) -> None:
        """Queue a request already checked (an Engine checks on the submitting thread and bounds the queue itself)."""
        request.history = request.prompt_array = np.asarray(request.prompt_ids, np.int64)
        request.prompt_key = hash(request.prompt_array.tobytes())
        if request.sampling.counts_tokens:
            request.counts = np.zeros(self.model.config.vocab_size, np.int32)
        request.rng = row_generator(request.sampling.seed, request.choice)
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
            self._finish(request, request.ended_by)
        for request in self.running:
            if request.cancelled:
                self._finish(request, request.ended_by)

    def _admit(self) -> None:
        later = []  # requests whose prompt a row is prefilling: they start from its slots once they are there
        held: dict[int, np.ndarray] = {}  # rows' held tokens, built once per step's admissions (rows may be long)
        waits: set = set()  # prompts (and settings) found waiting in this step: their twins wait without a search
        while self.waiting and None in self.rows:
            request = self.waiting.popleft()
            twin = (request.prompt_key, request.prompt_logprobs, self._speculates(request))
            if twin in waits:
                later.append(request)
                continue
            row, source, slots, runs = self._place(request, held)
            shifted = moved_tokens(runs)
            if self._awaits_a_prefill(request, slots + shifted):
                waits.add(twin)
                later.append(request)
                continue
            if slots and request.prompt_logprobs is not None:  # the positions before the reused slots: the row's
                k = request.prompt_logprobs
                request.prompt_lp = [(lp, top[:k]) for lp, top in self._scores(source, k)[:slots]]
            draft_slots = 0
            if self.drafter is not None and slots:  # the draft's pairs stay valid one short of the common start
                draft_slots = min(slots, reusable_slots(request.prompt_array, held[source],  # built by _place
                                                        int(self.drafter.written[source])))
            # what `row` holds past `slots`, overwritten or moved
            overwrites = source != row or bool(runs) or len(self.held[row]) - slots >= KEPT_TAIL
            if self.prefix_caching and overwrites and not self.caches.resident:
                held.pop(self._keep_hold(row, source), None)
            self.rows[row], request.row = request, row
            self.held[row], self.held_scores[row] = NONE, None
            held.pop(row, None)
            if source != row:
                self.caches.copy_slots(source, row, slots)
            if runs:
                self.caches.move_slots(source, row, runs)
            self.lengths[row] = request.prefilled = request.cached = slots + shifted
            request.shifted = shifted
            self.stats.cached_tokens += slots + shifted
            self.stats.shifted_tokens += shifted
            if self.drafter is not None:
                self.drafter.reset(row)
                if draft_slots:  # kept for a later request that drafts, whether or not this one does
                    self.drafter.reuse(row, source, draft_slots)
        self.waiting.extendleft(reversed(later))

    def _awaits_a_prefill(self, request: Request, slots: int) -> bool:
        """With prefix caching over host caches: a row still prefilling another prompt will hold more of this one's
        than the `slots` it could start from now, by at least half of what it would prefill (the choices of one
        prompt, clients sending one system prompt together), so this request waits for those slots instead of
        prefilling them too."""
        if not self.prefix_caching or self.caches.resident:
            return False
        prompt, k = request.prompt_array, request.prompt_logprobs
        for other in self.rows:
            if k is not None and (other is None or other.prompt_logprobs is None or other.prompt_logprobs < k):
                continue  # a prompt's logprobs come only from a row that kept as many of its own
            if other is not None and other.pending is None and other.prefilled < len(other.prompt_ids):
                coming = min(common_length(prompt, other.prompt_array), len(prompt) - 1)
                if coming > other.prefilled and 2 * (coming - slots) >= len(prompt) - slots:
                    return True
        return False

    def _place(self, request: Request, held: dict[int, np.ndarray]) -> tuple[int, int, int, list[Moved]]:
        """(the free row `request` goes to, the row whose slots it starts from, how many of its first, the runs of
        its later slots moved after them). It goes to the lowest free row, so the occupied rows stay a prefix (a
        decode pass covers every row up to the highest occupied one). With prefix caching it starts from the longest
        reusable start any row holds: copied there (host caches), or, for caches resident on a device, a free row's
        reused in place wherever it is; with cache_reuse, counting the runs that row's later tokens add (not for a
        request that drafts with the MTP head, or asks for its prompt's logprobs: those stop at the common start).
        A request for its prompt's logprobs starts only from a row that kept its own prompt's, as many per position.
        `held`: rows' held tokens already built in this step's admissions, added to."""
        free = [r for r, q in enumerate(self.rows) if q is None]
        best: tuple[int, int, int, list[Moved]] = (free[0], free[0], 0, [])
        ranked = (0, 0)  # best's slots reused and its exact start: the most reused, then the longest exact start
        if not self.prefix_caching:
            return best
        prompt, k = request.prompt_array, request.prompt_logprobs
        sources = free if self.caches.resident else range(self.max_batch)
        mtp = self.drafter is not None and self._speculates(request)
        for source in sources:
            scores = None if k is None else self._scores(source, k)
            if k is not None and scores is None:
                continue
            if source not in held:
                held[source] = self._held(source)
            slots = reusable_slots(prompt, held[source], int(self.drafter.written[source]) if mtp else None,
                                   None if scores is None else len(scores))
            runs = []
            if self.cache_reuse and not mtp and k is None:
                runs = moved_runs(prompt, held[source], slots, self.cache_reuse)
            rank = (slots + moved_tokens(runs), slots)
            if rank > ranked:
                best, ranked = (source if self.caches.resident else free[0], source, slots, runs), rank
        return best

    def _keep_hold(self, row: int, source: int) -> int | None:
        """Before free row `row` takes a request that does not start from its slots, or starts from only part of
        them (another chat sharing a system prompt): what it holds moves to the free row that holds nothing or was
        freed longest ago (not `source`, still to be copied from), unless `row`'s hold is the oldest: the free rows
        keep the most recent prompts, while requests take the lowest rows. Returns the row written, or None."""
        others = [r for r, q in enumerate(self.rows) if q is None and r not in (row, source)]
        if not len(self.held[row]) or not others:
            return None
        to = min(others, key=lambda r: (len(self.held[r]) > 0, self.freed_at[r]))
        if len(self.held[to]) and self.freed_at[to] > self.freed_at[row]:
            return None
        self.caches.copy_slots(row, to, len(self.held[row]))
        if self.drafter is not None:
            self.drafter.reuse(to, row, int(self.drafter.written[row]))
        self.held[to], self.held_scores[to] = self.held[row], self.held_scores[row]
        self.lengths[to], self.freed_at[to] = self.lengths[row], self.freed_at[row]
        return to

    def _held(self, row: int) -> np.ndarray:
        """The tokens whose entries row `row` holds in slots [0, lengths[row])."""
        request = self.rows[row]
        if request is None:
            return self.held[row]
        return held_tokens(request.prompt_ids, request.generated, int(self.lengths[row]))

    def _scores(self, row: int, k: int) -> list | None:
        """The prompt logprob entries row `row` holds (its request's, or the last one's), if they carry at least `k`
        alternatives each; else None."""
        request = self.rows[row]
        entries, kept = (request.prompt_lp, request.prompt_logprobs) if request is not None else (
            self.held_scores[row] or (None, None))
        return entries if entries is not None and kept is not None and kept >= k else None

    def _free_rows_fit(self, hi: int, width: int) -> None:
        """Free rows below `hi` ride along in a pass writing `width` slots from their lengths: one holding slots too
        close to the capacity forgets its last ones, so the pad fits."""
        for row in range(hi):
            end = self.caches.capacity - width
            if self.rows[row] is None and self.lengths[row] > end:
                self.lengths[row] = max(end, 0)
                self.held[row] = self.held[row][: self.lengths[row]]

    def _prefill(self) -> None:
        for request, t in self._chunks(self.rows):
            self._prefill_chunk(request, t)

    def _chunks(self, rows: Sequence[Request | None]) -> Iterator[tuple[Request, int]]:
        """This step's prefill chunks of the prompts in `rows`, (request, tokens), about `prefill_chunk` tokens in
        all; the consumer runs each chunk (advancing request.prefilled) before asking for the next."""
        budget = self.prefill_chunk
        for request in [r for r in rows if r is not None and r.pending is None]:
            while request.prefilled < len(request.prompt_ids) and budget > 0:
                # chunks of prefill_chunk from where the prompt starts (0, or past its cached slots): they do not
                # depend on the load
                t = min(self.prefill_chunk, len(request.prompt_ids) - request.prefilled)
                yield request, t
                budget -= t
            if budget <= 0:
                return

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
        every = request.prompt_logprobs is not None  # the logits of every position: the prompt's logprobs
        positions = np.arange(t, dtype=np.int64)[None] if every else np.array([[t - 1]], np.int64)
        binding.bind_cpu_input(io_spec.LOGITS_POSITIONS, positions)
        binding.bind_output(io_spec.LOGITS, "cpu")
        drafts = self.drafter is not None and self._speculates(request)
        if drafts:
            binding.bind_output(io_spec.HIDDEN, "cpu")
        views = self.caches.bind(binding, slice(row, row + 1))  # in place, this row's slice only
        session.run_with_iobinding(binding)
        del views
        if drafts:  # the MTP draft's pairs (h_i, t_{i+1}) this chunk's prompt holds (runtime.draft)
            hidden = binding.get_outputs()[1].numpy()  # [1, t, d]
            following = np.full((1, t), -1, np.int64)
            nxt = request.prompt_ids[start + 1 : start + t + 1]
            following[0, : len(nxt)] = nxt
            self.drafter.prefill(hidden, start, following, row)
            if start + t == len(request.prompt_ids):  # the last position's pair waits for the first token
                self.drafter.prompt_done(row, hidden[0, t - 1 : t].copy(), start + t - 1)
        request.prefilled += t
        self.lengths[row] = request.prefilled
        self._chunk_done(request, start, t, binding.get_outputs()[0].numpy())
        if drafts and request.pending is not None:
            self.drafter.first_token(row, request.pending)

    def _chunk_done(self, request: Request, start: int, t: int, logits: np.ndarray) -> None:
        """A prefill chunk of `request`'s prompt, tokens [start, start + t), has run: logits [1, positions, vocab]
        (every position's where its prompt logprobs are asked for, else the last's). Gathers the prompt logprobs;
        after the prompt's last chunk, emits them and samples the first token (or finishes a request for 0)."""
        self.stats.prefill_tokens += t
        if request.prompt_logprobs is not None:
            # position start + j predicts prompt token start + j + 1 (the chunk's last predicts the next chunk's first)
            targets = request.prompt_ids[start + 1 : start + t + 1]
            request.prompt_lp = (request.prompt_lp or []) + _token_logprobs(logits[0, :len(targets)], targets,
                                                                            request.prompt_logprobs)
        if start + t == len(request.prompt_ids):
            if request.prompt_logprobs is not None:
                request.emit(PromptLogprobs(request.prompt_lp))  # kept: a later prompt may start from this row
            if request.max_new_tokens == 0:
                self._finish(request, "length")
                return
            if self._fail_unusable([request], logits[:, -1:]):  # [request] while its logits are usable
                self._sample_and_emit(request, logits[:, -1])  # [1, vocab]

    def _decode_step(self, decoding: list[Request]) -> None:
        hi = max(r.row for r in decoding) + 1
        if (self.speculation.on and self.stats.steps >= self._lookups_rest_until
                and any(self._speculates(r) for r in decoding)):
            drafts = self._propose(decoding, hi)
            if any(len(d) for d in drafts):
                self._verify_step(decoding, hi, drafts)
                return
        t0 = time.perf_counter()
        grew = self.caches.ensure(self._longest(hi) + 1)
        self._free_rows_fit(hi, 1)
        if grew or self._decode is None or self._decode.rows != hi:
            self._decode = DecodeBinding(self.model.sessions[io_spec.DECODE], self.caches, hi,
                                         self.model.config.vocab_size)
        d = self._decode
        d.ids[:] = 0  # pad rows
        for r in decoding:
            d.ids[r.row, 0] = r.pending
        d.pos[:, 0] = self.lengths[:hi]
        d.write[:] = self.lengths[:hi]
        d.run(self.model.sessions[io_spec.DECODE])
        for r in decoding:
            self.lengths[r.row] += 1
        self.stats.decode_steps += 1
        self.stats.decoded_rows += len(decoding)
        chosen = self._choose(decoding, d.logits[:, 0])
        decoding = [r for r in decoding if r.id in chosen]  # the others failed (their logits unusable)
        for r in decoding:
            row, start = r.row, int(self.lengths[r.row]) - 1
            self._sample_and_emit(r, d.logits[row : row + 1, 0], chosen[r.id])
            if self.drafter is not None and r.pending is not None and self._speculates(r):
                self.drafter.commit(row, np.array([r.pending]), d.hidden[row, :1].copy(), start)
            if r.pending is not None and self._speculates(r):
                r.acceptance = updated_acceptance(r.acceptance, 0, 0)  # a step without drafts
        if self.costs is not None:
            self.clock.observe("plain", time.perf_counter() - t0, self.costs.at(hi).decode, len(decoding),
                               len(decoding))

    def _choose(self, decoding: list[Request], logits: np.ndarray, first_row: int = 0) -> dict[int, int]:
        """Each decoding request's next token, by request id, from its row of `logits` [rows, vocab] (row r.row -
        first_row): one argmax for every plain greedy row, one sample() per sampling setting for the others (each
        row drawing from its own generator). A request whose logits are unusable (NaN or infinity) ends with Failed
        and has no entry: a greedy row's argmax lands on its first NaN, or +inf, or on -inf where all are, so the
        logit it picks says so; the others are checked before sampling (_fail_unusable)."""
        plain = [r for r in decoding if _plain_greedy(r)]
        greedy = logits[[r.row - first_row for r in plain]]
        best = greedy.argmax(-1)
        picked = greedy[np.arange(len(plain)), best]
        for r, logit, row_logits in zip(plain, picked, greedy):
            if not np.isfinite(logit):
                self._fail(r, row_logits)
        chosen = {r.id: int(t) for r, t, logit in zip(plain, best, picked) if np.isfinite(logit)}
        alike: dict[SamplingParams, list[Request]] = {}  # the other rows by their sampling, seeds aside
        others = [r for r in decoding if not _plain_greedy(r)]
        for r in self._fail_unusable(others, logits[[r.row - first_row for r in others]]):
            alike.setdefault(replace(r.sampling, seed=None), []).append(r)
        for params, rows in alike.items():
            tokens = sample(logits[[r.row - first_row for r in rows]], params, [r.rng for r in rows],
                            [r.history for r in rows], [r.counts for r in rows], self._allowed(rows))
            chosen.update(zip((r.id for r in rows), tokens.tolist()))
        return chosen

    # ---- speculation (runtime.speculative) ----
    def _speculates(self, request: Request) -> bool:
        return self.drafts_pay and request.speculate and request.constraint is None

    def _propose(self, decoding: list[Request], hi: int) -> list[np.ndarray]:
        """Drafts for rows [0, hi): the speculating rows' proposals (the MTP draft catches every such row up first),
        none for the others. Every row writes the pass's width from its length, so no draft may take a row past the
        export's length; nor past its own token budget (the token drawn after the accepted drafts comes on top)."""
        end = self.model.max_seq_len - 1 - self._longest(hi)
        by_row: list[Request | None] = [None] * hi  # the speculating rows
        acceptances: list[float | None] = [None] * hi  # every decoding row's (0: one that does not speculate)
        for r in decoding:
            speculates = self._speculates(r) and not r.stops_held  # a held row's token is sampled under its mask
            by_row[r.row] = r if speculates else None
            acceptances[r.row] = r.acceptance if speculates else 0.0
        rooms = [0 if r is None else max(0, min(self.speculation.draft_tokens, r.max_new_tokens - len(r.generated) - 1,
                                                end)) for r in by_row]
        spec = self.speculation
        policy = DraftPolicy(self.costs.at(hi), self.drafter is not None, self.clock)
        if self.drafter is None:
            if not any(policy.lengths(acceptances, rooms)):  # none would draft even with every room filled: no lookups,
                self._lookups_rest_until = self.stats.steps + QUIET_STEPS  # nor for a few steps (estimates move slowly)
                return [np.zeros(0, np.int64)] * hi
            drafts = [np.zeros(0, np.int64) if r is None else lookup(r.history, room, spec.ngram, spec.min_ngram)
                      for r, room in zip(by_row, rooms)]
            return [d[:m] for d, m in zip(drafts, policy.lengths(acceptances, [len(d) for d in drafts]))]
        return self.drafter.propose(range(hi), policy.lengths(acceptances, rooms))

    def _verify_step(self, decoding: list[Request], hi: int, drafts: list[np.ndarray]) -> None:
        """One verification pass over rows [0, hi): each decoding row's pending token and drafts at its length."""
        t0 = time.perf_counter()
        width = 1 + max(len(d) for d in drafts)
        if self.caches.ensure(self._longest(hi) + width):
            self._decode = None
        self._free_rows_fit(hi, width)
        ids = np.zeros((hi, width), np.int64)  # rows not decoding ride along with padding at their own length
        for r in decoding:
            ids[r.row, 0] = r.pending
            ids[r.row, 1 : 1 + len(drafts[r.row])] = drafts[r.row]
        starts = self.lengths[:hi].copy()
        logits, hidden = verification_pass(self.model, self.caches, ids, starts)
        self.stats.decode_steps += 1
        self.stats.decoded_rows += len(decoding)
        self.stats.speculation.verify_steps += 1
        emitted = 0
        decoding = self._fail_unusable(decoding, [logits[r.row, : len(drafts[r.row]) + 1] for r in decoding])
        for r in decoding:
            row, d = r.row, drafts[r.row]
            if r.constraint is None and not r.stops_held:
                tokens = accept_row(logits[row, : len(d) + 1], d, r.sampling, r.history, r.counts, r.rng)
            else:  # a row under a mask (a grammar's, min_tokens') does not speculate: one token sampled under it
                tokens = [
                    int(sample(logits[row, :1], r.sampling, r.rng, [r.history], [r.counts], self._allowed([r]))[0])
                ]
            self.stats.speculation.add(len(d), len(tokens) - 1)
            r.acceptance = updated_acceptance(r.acceptance, len(d), len(tokens) - 1)
            self.lengths[row] += len(tokens)  # its pending token and the accepted drafts are in its cache now
            emitted += len(tokens)
            for j, token in enumerate(tokens):
                self._sample_and_emit(r, logits[row, j : j + 1], token)
                if r.row is None:  # finished (a stop token, its budget): the rest is dropped
                    break
            if self.drafter is not None and r.row is not None and self._speculates(r):
                self.drafter.commit(row, np.array(tokens), hidden[row, : len(tokens)].copy(), int(starts[row]))
        self.clock.observe("verify", time.perf_counter() - t0, self.costs.at(hi).verify[width], emitted,
                           len(decoding))

    def _sample_and_emit(self, request: Request, logits: np.ndarray, token: int | None = None) -> None:
        """logits [1, vocab]: sample this request's next token (unless already chosen), emit it, and finish the
        request if it stops."""
        if token is None:
            token = int(sample(logits, request.sampling, request.rng, [request.history], [request.counts],
                               self._allowed([request]))[0])
        if request.constraint is not None:
            try:
                request.constraint.consume(token)
            except GrammarError as e:  # its grammar's own failure: this request ends, the others run on
                self._finish(request, "error", Failed(e))
                return
        request.generated.append(token)
        if request.sampling.repetition_penalty != 1.0 or self._speculates(request):  # the readers of the history
            request.remember(token)
        if request.counts is not None:
            request.counts[token] += 1
        self.stats.generated_tokens += 1
        event = TokenEvent(token)
        if request.logprobs is not None:
            (event.logprob, event.top_logprobs), = _token_logprobs(logits, [token], request.logprobs)
        request.emit(event)
        if token in request.stop_token_ids or request.constraint is not None and request.constraint.done:
            self._finish(request, "stop")
        elif len(request.generated) >= request.max_new_tokens:
            self._finish(request, "length")
        else:
            request.pending = token

    def _fail_unusable(self, requests: list[Request], logits: np.ndarray | list[np.ndarray]) -> list[Request]:
        """`requests` whose logits are usable: `logits` [n, ..., vocab] (or a list of n arrays [..., vocab]) holds
        each one's, in order. Each of the others ends with Failed (sampling.unusable_rows: NaN or infinity), the
        rest running on; its row is freed and its cache not kept for a later prompt."""
        bad = (unusable_rows(logits) if isinstance(logits, np.ndarray)
               else np.array([unusable_rows(x[None])[0] for x in logits], bool))
        for i in np.flatnonzero(bad):
            self._fail(requests[i], logits[i])
        return [r for r, b in zip(requests, bad) if not b]

    def _fail(self, request: Request, logits: np.ndarray) -> None:
        """End `request`, whose `logits` are unusable, with Failed naming it; its row freed and zeroed."""
        row = request.row
        error = unusable_logits(logits, f"request {request.id}, after {len(request.generated)} tokens")
        self._finish(request, "error", Failed(error))
        self._clear_row(row)

    def _clear_row(self, row: int) -> None:
        """Row `row`'s cache slots zeroed (CacheBuffers.clear_row) after its request failed."""
        if self.caches.clear_row(row):
            self._decode = None  # resident caches replaced: bound again at the next step

    def _finish(self, request: Request, reason: str, failure: Failed | None = None) -> None:
        """`reason` counted and emitted in a Finished; with a `failure`, that is emitted instead (reason "error")."""
        if request.row is not None:
            row = request.row
            kept = self.prefix_caching and failure is None
            self.held[row] = self._held(row) if kept else NONE  # kept for a later prompt
            scored = self.prefix_caching and request.prompt_logprobs is not None and request.prompt_lp is not None
            self.held_scores[row] = (request.prompt_lp, request.prompt_logprobs) if scored else None
            self.rows[row] = None
            self.lengths[row] = len(self.held[row])
            self.freed_at[row] = sum(self.stats.finished.values())
            request.row = None
        request.pending = None
        self.stats.finished[reason] += 1
        request.emit(failure or Finished(reason, len(request.prompt_ids), len(request.generated), request.cached,
                                         request.shifted))

    def _longest(self, hi: int) -> int:
        """The most slots an occupied row below `hi` holds (0: none)."""
        return max((int(self.lengths[r]) for r in range(hi) if self.rows[r] is not None), default=0)


    def _allowed(self, rows: list[Request]) -> np.ndarray | None:
        """These rows' masks [rows, vocab]: a grammar's next tokens, less the stop ids of a row short of its
        min_tokens; None when no row has either."""
        vocab = self.model.config.vocab_size
        allowed = allowed_tokens([r.constraint for r in rows], vocab)
        for i, r in enumerate(rows):
            if r.stops_held:
                allowed = np.ones((len(rows), vocab), bool) if allowed is None else allowed
                held = allowed[i].copy()
                held[[t for t in r.stop_token_ids if 0 <= t < vocab]] = False
                if held.any():  # else a grammar allows only the end: its document is complete, min_tokens yields
                    allowed[i] = held
        return allowed


def _plain_greedy(request: Request) -> bool:
    """Greedy on the model's own logits (no penalty, bias or mask): their argmax, the same for every such row."""
    return request.sampling.greedy and request.sampling.plain and request.constraint is None and not request.stops_held


LOGPROB_ROWS = 64  # positions whose log-normalizers are taken at once: a few [64, vocab] temporaries


def _token_logprobs(logits: np.ndarray, tokens: Sequence[int], k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """logits [n, vocab] and the token that followed each position -> (its log-probability, the k likeliest
    (token, log-probability) pairs, likeliest first, ties by id), under the model's own distribution.

    Each position's log-normalizer is its max plus the log of a float64 sum of exponentials in the logits' precision
    (at least float32's: within 1e-7 of a float64 log-softmax for logits of the model's range), and only the entries
    returned are looked up, not a whole [n, vocab] log-softmax; k = 1 (what lm-eval asks) is an argmax."""
    vocab = logits.shape[-1]
    out = []
    for start in range(0, len(logits), LOGPROB_ROWS):
        z = logits[start:start + LOGPROB_ROWS].astype(np.result_type(logits.dtype, np.float32), copy=False)
        peak = z.max(-1)
        log_z = peak.astype(np.float64) + np.log(np.exp(z - peak[:, None]).sum(-1, dtype=np.float64))
        for row, norm, token in zip(z, log_z, tokens[start:start + LOGPROB_ROWS]):
            top = _likeliest(row, min(k, vocab))
            out.append((float(row[token] - norm), [(int(i), float(row[i] - norm)) for i in top]))
    return out


def _likeliest(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest entries of `row`, largest first, equal ones by id (the lowest first, also at the
    k-th place)."""
    if k <= 0:
        return np.arange(0)
    if k == 1:
        return row.argmax()[None]  # the first of equal maxima
    least = np.partition(row, len(row) - k)[len(row) - k]  # the k-th largest value
    ties = np.flatnonzero(row >= least)
    return ties[np.lexsort((ties, -row[ties]))][:k]
