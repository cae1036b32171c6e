"""Speculative decoding: proposals (prompt lookup, the MTP draft graph) and their acceptance. numpy only.

A step proposes up to k tokens per row cheaply, the full model checks them in one verification pass over the
existing latent cache (logits at the row's pending token and at each proposed one), and the row keeps the longest
prefix the target accepts plus one token of its own; rollback is the row's length alone (the rejected rows of the
cache are overwritten by the next step).

Acceptance keeps the sampler's distribution exactly (speculative sampling: Leviathan et al. 2023, Chen et al. 2023).
At position j, p is the distribution sample() draws from there (runtime.sampling.distribution: the penalties see the
drafts accepted before j) and d the draft. Both proposers here are deterministic (prompt lookup; the MTP draft's
argmax), so the proposal q is one-hot at d and the rule "accept d with probability min(1, p(d) / q(d)), else draw from
max(0, p - q) normalized" becomes: accept d with probability p(d), else draw from p with d removed. That is exactly
one draw x from p, accepting d when x = d and emitting x otherwise: P(d) = p(d), and for x != d,
(1 - p(d)) p(x) / (1 - p(d)) = p(x). The draw is the sampler's own (one uniform from the row's generator, the same
inverse CDF), one per emitted token as without speculation: a seeded request emits the tokens it emits without
speculation, however many drafts a step takes (up to float rounding between the graphs' logits). Greedy (p one-hot
at the argmax) is the same rule: accept while d is the argmax, then emit the argmax.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from .. import io_spec
from ..errors import InputError
from .cache import CacheBuffers, DecodeBinding
from .draft import MAX_DRAFT_TOKENS, MTPDrafter
from .sampling import SamplingParams, adjusted_logits, distribution, draw, finite, is_integer, uniform

MODES = ("auto", "off", "lookup", "mtp")
PRIOR_ACCEPTANCE = 0.6  # a row's acceptance estimate before its first verification
ACCEPTANCE_MEMORY = 0.7  # each verification moves the estimate 30 % of the way to what it saw
REVISIT = 0.05  # each step a row drafts nothing moves its estimate 5 % of the way back to the prior
WALL_MEMORY = 0.9  # each scheduler step moves the WallClock estimate it informs 10 % of the way to what it measured
WALL_EXCESS_CAP = 4.0  # one step's time beyond its graph's cost counts at most this many times that cost (WallClock)


@dataclass(frozen=True)
class Speculation:
    """How a generation speculates: `mode` off, lookup (prompt lookup: any export with a verify graph), mtp (the
    export's draft graph) or auto (mtp where the export has a draft graph whose drafts can pay, else lookup; off for
    an export without a verify graph); at most `draft_tokens` proposed per step, fewer where the measured costs and
    the row's acceptance say fewer pay (DraftPolicy); lookup matches the last `ngram` tokens down to `min_ngram`."""
    mode: str = "off"
    draft_tokens: int = 4
    ngram: int = 3
    min_ngram: int = 2

    def resolve(self, model, mtp_pays: Callable[[object, int], bool] | None = None) -> "Speculation":
        """auto made concrete for `model` (an ExportedModel), validated: off where no verification pass fits (an
        export shorter than draft_tokens + 1); mtp where the export has a draft graph and `mtp_pays(model, k)`
        (default mtp_drafts_pay: a draft call cheap enough against a step that drafts pay at the prior acceptance),
        else lookup, whose proposals cost nothing to make."""
        mode = self.mode
        if mode == "auto":
            k = self.draft_tokens
            fits = is_integer(k) and 1 <= k <= MAX_DRAFT_TOKENS and pass_fits(k, model.max_seq_len)
            mode = ("off" if not fits else
                    "mtp" if model.has_draft and (mtp_pays or mtp_drafts_pay)(model, k) else
                    "lookup" if model.has_graph(io_spec.VERIFY) else "off")
        return replace(self, mode=mode).validate(model.max_seq_len, model.has_draft)

    def validate(self, max_seq_len: int | None = None, has_draft: bool | None = None) -> "Speculation":
        """InputError naming the problem; `max_seq_len` and `has_draft`: the export's, where known."""
        if self.mode not in MODES:
            raise InputError(f"speculative={self.mode!r}: expected one of {', '.join(MODES)}")
        k = self.draft_tokens
        if not is_integer(k) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise InputError(f"draft_tokens={k!r}: must be an integer in [1, {MAX_DRAFT_TOKENS}]")
        if max_seq_len is not None and self.mode != "off" and not pass_fits(k, max_seq_len):
            raise InputError(f"draft_tokens={k}: a verification pass of {k + 1} tokens does not fit the export's "
                             f"maximum length {max_seq_len}")
        if not (is_integer(self.ngram) and is_integer(self.min_ngram) and 1 <= self.min_ngram <= self.ngram):
            raise InputError(f"ngram={self.ngram!r}, min_ngram={self.min_ngram!r}: need 1 <= min_ngram <= ngram")
        if self.mode == "mtp" and has_draft is False:
            raise InputError("speculative='mtp' needs the export's draft graph (draft.onnx), written from a checkpoint "
                             "with an MTP layer (num_nextn_predict_layers >= 1); this export has none: use 'lookup'")
        return self

    @property
    def on(self) -> bool:
        return self.mode != "off"


def mtp_drafts_pay(model, k: int) -> bool:
    """Whether the export's MTP drafts can pay for one row at the prior acceptance, by the step costs measured here
    (DraftPolicy.ever_drafts, the test Generator and Scheduler make before a row drafts): where not, a generation in
    mode mtp never drafts, and prompt lookup is what can speed it."""
    return DraftPolicy(measure_costs(model, 1, k, mtp=True), mtp=True).ever_drafts(1, k)


def pass_fits(draft_tokens: int, max_seq_len: int) -> bool:
    """A verification pass (the pending token and `draft_tokens` drafts: draft_tokens + 1 positions) fits an export
    of `max_seq_len` after one token of prompt."""
    return draft_tokens < max_seq_len


@dataclass
class SpeculationStats:
    """Draft tokens proposed and accepted, and how often a step's first draft token was accepted."""
    verify_steps: int = 0  # verification passes (steps with at least one row proposing)
    proposed: int = 0
    accepted: int = 0
    first_proposed: int = 0  # rows of verification passes that proposed at least one token
    first_accepted: int = 0  # ... whose first proposed token was accepted

    def add(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        if proposed:
            self.first_proposed += 1
            self.first_accepted += accepted > 0

    def to_dict(self) -> dict:
        return {"verify_steps": self.verify_steps, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance": round(self.accepted / self.proposed, 4) if self.proposed else None,
                "first_token_acceptance": round(self.first_accepted / self.first_proposed, 4)
                if self.first_proposed else None}


# ---- how many to draft ----
@dataclass
class Costs:
    """Measured seconds of one step for a batch of rows: a plain decode step, a verification pass of T tokens per
    row, and one call of the draft graph (0 without one)."""
    decode: float
    verify: dict[int, float]
    draft: float = 0.0


@dataclass
class DraftPolicy:
    """Draft lengths that maximize the expected tokens per second of a batch. With acceptance estimate a (each draft
    token accepted with probability a once the ones before it were), a row with m drafts emits 1 + a + ... + a^m
    tokens in a verification pass; the pass is as wide as the longest row's drafts + 1 and costs the same for every
    row in it, with m draft calls before it (the MTP draft's first call also catches it up on the tokens committed
    since); no drafts anywhere: a decode step. So one common cap m is chosen for the batch, from the expected tokens
    of all its rows against the pass's cost: a batch of 8 where one row has a draft pays for the pass of all 8. Costs
    are measured (measure_costs, CostModel)."""
    costs: Costs
    mtp: bool
    clock: WallClock | None = None  # the Python around the steps (a scheduler's); None: the graphs alone

    def lengths(self, acceptances: Sequence[float | None], available: Sequence[int]) -> list[int]:
        """Each row's draft length given its acceptance estimate (None: a row that does not speculate, or no row at
        all) and the drafts it has or may make."""
        rows = [(min(max(a, 0.0), 0.999), n) for a, n in zip(acceptances, available) if a is not None]
        draft = self.costs.draft if self.mtp else 0.0
        token, row = (self.clock.per_token, self.clock.per_pass_row) if self.clock else (0.0, 0.0)
        best, rate = 0, len(rows) / (self.costs.decode + token * len(rows))
        for m in range(1, max((n for _, n in rows), default=0) + 1):
            tokens = sum((1 - a ** (min(m, n) + 1)) / (1 - a) for a, n in rows)
            r = tokens / (self.costs.verify[m + 1] + m * draft + token * tokens + row * len(rows))
            if r > rate:
                best, rate = m, r
        return [0 if a is None else min(best, n) for a, n in zip(acceptances, available)]

    def length(self, acceptance: float, available: int) -> int:
        """lengths() for a batch of one row."""
        return self.lengths([acceptance], [available])[0]

    def ever_pays(self, rows: int, k: int) -> bool:
        """Whether drafts could pay at all for `rows` rows: with every draft accepted (the estimate's ceiling) and k
        of them a row. Where not, speculating only adds its bookkeeping to every step."""
        return any(self.lengths([1.0] * rows, [k] * rows))

    def ever_drafts(self, rows: int, k: int) -> bool:
        """Whether a row can ever come to draft. Prompt lookup's rows learn from the proposals they do not verify
        (shadow_acceptance), so wherever drafts could pay. An MTP row learns only from drafts it verifies and, with
        none, drifts back to the prior it starts at (updated_acceptance): where the prior does not pay it never
        drafts, and speculating would only add its bookkeeping (and the draft graph's catching up) to every step."""
        if not self.ever_pays(rows, k):
            return False
        return not self.mtp or any(self.lengths([PRIOR_ACCEPTANCE] * rows, [k] * rows))


@dataclass
class WallClock:
    """The time a scheduler's steps take beyond the graph costs it measured at start (which time the graphs alone):
    `per_token`, the Python of each token a step emits (sampling, stop checks, events), learned from plain steps; and
    `per_pass_row`, what a verification pass adds for each of its rows on top of that (acceptance, bookkeeping),
    learned from passes. A token costs the same to emit whichever step emits it, so it narrows what drafts gain:
    DraftPolicy weighs each form as its graph cost plus these. Each step moves its estimate (1 - WALL_MEMORY) of the
    way to what it measured, an observation capped at WALL_EXCESS_CAP times the graph's cost (a step stalled by
    another thread is not the form's cost)."""
    per_token: float = 0.0
    per_pass_row: float = 0.0

    def observe(self, form: str, seconds: float, cost: float, tokens: int, rows: int) -> None:
        """A step of `form` ("plain" or "verify") over `rows` rows took `seconds`, emitting `tokens`, where its graph
        costs `cost`."""
        if cost <= 0 or tokens <= 0 or rows <= 0:
            return
        excess = min(max(seconds - cost, 0.0), WALL_EXCESS_CAP * cost)
        if form == "plain":
            self.per_token = WALL_MEMORY * self.per_token + (1 - WALL_MEMORY) * excess / tokens
        else:
            extra = max(excess - self.per_token * tokens, 0.0) / rows
            self.per_pass_row = WALL_MEMORY * self.per_pass_row + (1 - WALL_MEMORY) * extra


def updated_acceptance(estimate: float, proposed: int, accepted: int) -> float:
    """A row's acceptance estimate after a step: accepted successes of accepted + (1 if one was rejected) trials,
    folded in with ACCEPTANCE_MEMORY; after a step it proposed nothing in, REVISIT of the way back to the prior, so
    that a row whose drafts stopped paying tries again after a while (text changes: a restated passage begins)."""
    if not proposed:
        return estimate + REVISIT * (PRIOR_ACCEPTANCE - estimate)
    trials = accepted + (accepted < proposed)
    return ACCEPTANCE_MEMORY * estimate + (1 - ACCEPTANCE_MEMORY) * accepted / trials


def shadow_acceptance(estimate: float, proposal: Sequence[int], emitted: int) -> float:
    """A row whose free proposal (prompt lookup's) the policy did not verify: its first proposed token against the
    token the row emitted instead, as evidence of acceptance at no cost. Greedy, a draft token is accepted exactly when
    it is the token emitted; sampled, a one-hot draft is accepted with probability p(token), the chance that the
    emitted token is it: one Bernoulli trial of the same rate either way. Without it a row whose prior acceptance does
    not pay would never draft, and so never learn that its drafts do. No proposal: updated_acceptance's drift."""
    if len(proposal) == 0:
        return updated_acceptance(estimate, 0, 0)
    return updated_acceptance(estimate, 1, int(int(proposal[0]) == int(emitted)))


@dataclass
class CostModel:
    """Costs measured for one row and for `rows` rows; between them, each cost affine in the rows (a step's weight
    reads are the same for any batch; its arithmetic and cache reads grow with the rows)."""
    one: Costs
    many: Costs
    rows: int

    def at(self, rows: int) -> Costs:
        if self.rows == 1:
            return self.one
        f = (min(max(rows, 1), self.rows) - 1) / (self.rows - 1)
        mix = lambda x, y: x + f * (y - x)  # noqa: E731
        return Costs(mix(self.one.decode, self.many.decode),
                     {t: mix(v, self.many.verify[t]) for t, v in self.one.verify.items()},
                     mix(self.one.draft, self.many.draft))


def measure_cost_model(model, rows: int, k: int, mtp: bool) -> CostModel:
    """The CostModel for batches of 1 to `rows` rows: measure_costs at 1 and at `rows` (the scheduler measures it
    once, when it starts, so that no request waits on the measurement)."""
    one = measure_costs(model, 1, k, mtp)
    return CostModel(one, measure_costs(model, rows, k, mtp) if rows > 1 else one, rows)


# each step form is timed for at least this long: the demo's 0.3 ms step, timed 3 times, drew a fastest figure that
# one time in two runs made no draft pay even on a prompt whose drafts were all accepted
MEASURE_SECONDS = 0.01


def measure_costs(model, rows: int, k: int, mtp: bool, context: int = 64, repeats: int = 3) -> Costs:
    """Time each step form for `rows` rows at `context` tokens, the fastest of `repeats` runs each; cached on the
    model per (rows, k, mtp)."""
    key = (rows, k, mtp)
    cache = model.__dict__.setdefault("_speculation_costs", {})
    if key in cache:
        return cache[key]
    if (rows, k, True) in cache:  # the steps of an MTP measurement (speculative 'auto' made one): no draft call
        cache[key] = replace(cache[(rows, k, True)], draft=0.0)
        return cache[key]
    cfg = model.config
    context = max(1, min(context, model.max_seq_len - k - 2))
    caches = CacheBuffers(cfg, rows, context + k + 1, model.max_seq_len, model.device, model.cache_format,
                          resident=model.resident_caches)
    lengths = np.full(rows, context, np.int64)
    decode = DecodeBinding(model.sessions[io_spec.DECODE], caches, rows, cfg.vocab_size)
    decode.pos[:], decode.write[:] = context, context

    def fastest(run) -> float:  # of `repeats` runs, and of as many as MEASURE_SECONDS holds for a fast step
        run()
        times = []
        while len(times) < repeats or sum(times) < MEASURE_SECONDS:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return min(times)

    # distinct tokens, as drafts are: a MoE pass reads the experts its tokens route to, and t copies of one token
    # would route to one token's experts (the demo: 5 distinct tokens read about 3x its routed experts' bytes)
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(cfg.vocab_size, k + 1, replace=False) for _ in range(rows)]).astype(np.int64)
    verify, slowest = {}, 0.0
    for t in range(2, k + 2):  # a pass of more tokens never costs less than one of fewer: the noise is smoothed so
        first = np.ascontiguousarray(ids[:, :t])  # made once, outside the timing
        slowest = max(slowest, fastest(lambda first=first: verification_pass(model, caches, first, lengths)))
        verify[t] = slowest
    costs = Costs(fastest(lambda: decode.run(model.sessions[io_spec.DECODE])), verify)
    if mtp:
        drafter = MTPDrafter(model, rows)
        hidden = np.zeros((rows, 1, cfg.hidden_size), np.float32)
        costs.draft = fastest(lambda: drafter.run(np.zeros((rows, 1), np.int64), hidden, lengths, np.zeros(rows)))
    cache[key] = costs
    return costs


# ---- proposals ----
def lookup(history: np.ndarray, k: int, ngram: int, min_ngram: int = 1) -> np.ndarray:
    """Prompt lookup: the up to k tokens that followed the latest earlier occurrence of the last n tokens of
    `history` (prompt and output), for the longest n in [min_ngram, ngram] that occurs; empty where none does."""
    size = len(history)
    if k < 1 or size < min_ngram + 1:
        return history[:0]
    # candidate ends: earlier positions holding the last token (the suffix itself, ending at size - 1, excluded)
    ends = np.flatnonzero(history[: size - 1] == history[size - 1])
    for n in range(min(ngram, size - 1), min_ngram - 1, -1):
        matched = ends[ends >= n - 1]
        for back in range(1, n):
            matched = matched[history[matched - back] == history[size - 1 - back]]
        if len(matched):
            start = matched[-1] + 1  # the latest occurrence; what followed it (it may run into the suffix)
            return history[start : start + k]
    return history[:0]


# ---- acceptance ----
def accept_row(logits: np.ndarray, drafts: Sequence[int], params: SamplingParams, history: np.ndarray,
               counts: np.ndarray | None, rng: np.random.Generator) -> list[int]:
    """One row's verification: logits [m + 1, vocab] at its pending token and its m drafts. Returns the tokens it
    emits: the accepted drafts, then one drawn from the target (at most m + 1), each from one draw of the sampler
    (module docstring). `history` and `counts` are the row's before this step (not changed here)."""
    m = len(drafts)
    if params.greedy and params.plain:  # the model's own argmax: one pass over every position
        best = finite(logits).argmax(-1)
        a = 0
        while a < m and drafts[a] == best[a]:
            a += 1
        return [int(t) for t in drafts[:a]] + [int(best[a])]
    out: list[int] = []
    seen, counted = history, None if counts is None else counts.copy()
    for j in range(m + 1):
        row, hist, cnt = logits[j : j + 1], [seen], None if counted is None else [counted]
        if params.greedy:  # penalties or bias: the argmax of the adjusted logits, as sample() takes it
            token = int(adjusted_logits(row, params, hist, cnt).argmax())
        else:
            token = int(draw(distribution(row, params, hist, cnt), uniform(rng, 1))[0])
        out.append(token)
        if j == m or token != drafts[j]:
            return out
        if params.repetition_penalty != 1.0:
            seen = np.append(seen, token)
        if counted is not None:
            counted[token] += 1
    return out


# ---- the verification pass ----
def verification_pass(model, caches, ids: np.ndarray, lengths: np.ndarray,
                      form: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """ids [rows, T] (each row's pending token, then its drafts, then padding) at slots lengths[r] ..; the caches'
    first `rows` rows written in place. Returns logits [rows, T, vocab] and the final hidden states [rows, T, d] (None
    from an export without them). `form`: the verify graph (the absorbed attention over T tokens) where the export
    has it, else the prefill graph's chunked form; both: query t of row r sits at slot lengths[r] + t and sees every
    slot up to it."""
    rows, t = ids.shape
    form = form or (io_spec.VERIFY if model.has_graph(io_spec.VERIFY) else io_spec.PREFILL)
    model.load(form)
    session = model.sessions[form]
    binding = session.io_binding()
    binding.bind_cpu_input(io_spec.INPUT_IDS, ids)
    binding.bind_cpu_input(io_spec.POSITION_IDS, lengths[:, None] + np.arange(t, dtype=np.int64))
    binding.bind_cpu_input(io_spec.ATTENTION_MASK, np.ones((rows, caches.capacity), np.int64))
    binding.bind_cpu_input(io_spec.WRITE_INDICES, np.ascontiguousarray(lengths, np.int64))
    if form == io_spec.PREFILL:
        binding.bind_cpu_input(
            io_spec.LOGITS_POSITIONS, np.broadcast_to(np.arange(t, dtype=np.int64), (rows, t)).copy()
        )
    outputs = [o.name for o in session.get_outputs() if o.name in (io_spec.LOGITS, io_spec.HIDDEN)]
    for name in outputs:
        binding.bind_output(name, "cpu")
    views = caches.bind(binding, None if rows == caches.batch else slice(0, rows))
    session.run_with_iobinding(binding)
    del views
    values = dict(zip(outputs, binding.get_outputs()))
    hidden = values.get(io_spec.HIDDEN)
    return values[io_spec.LOGITS].numpy(), None if hidden is None else hidden.numpy()
