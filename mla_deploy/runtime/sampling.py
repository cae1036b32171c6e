"""Sampling options in one dataclass, and pure numpy sampling from logits."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError, ModelOutputError

NUCLEUS_RATIOS = (2.0**-7, 2.0**-14)  # top-p first looks for the nucleus among tokens this likely x the likeliest
NUCLEUS_MAX_CANDIDATES = 8192  # ... unless there are more of them than this (nucleus_ids())


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    repetition_penalty: float = 1.0  # 1: off; >1 discourages tokens already in the sequence
    seed: int | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit), ids ascending
    min_p: float = 0.0  # 0: off; keeps the tokens with at least min_p x the likeliest one's probability

    PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's bounds on presence_penalty and frequency_penalty
    BIAS_RANGE = (-100.0, 100.0)  # and on logit_bias values

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """InputError naming the first field out of range (numpy numbers are numbers, booleans are not);
        `vocab_size`: the model's, which logit_bias ids must fall in."""
        if not (_real(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise InputError(f"temperature={self.temperature!r}: must be a finite number >= 0 (0 is greedy)")
        if not (is_integer(self.top_k) and self.top_k >= 0):
            raise InputError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 disables it)")
        if not (_real(self.top_p) and 0 < self.top_p <= 1):
            raise InputError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not (_real(self.min_p) and 0 <= self.min_p <= 1):
            raise InputError(f"min_p={self.min_p!r}: must be in [0, 1] (0 is off)")
        if not (_real(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise InputError(f"repetition_penalty={self.repetition_penalty!r}: must be a finite number > 0")
        if self.seed is not None and not (is_integer(self.seed) and self.seed >= 0):
            raise InputError(f"seed={self.seed!r}: must be a non-negative integer")
        lo, hi = self.PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_real(value) and lo <= value <= hi):
                raise InputError(f"{name}={value!r}: must be a number in [{lo:g}, {hi:g}] (0 is off)")
        lo, hi = self.BIAS_RANGE
        for entry in self.logit_bias:
            token, bias = entry if isinstance(entry, tuple) and len(entry) == 2 else (None, None)
            if not (is_integer(token) and token >= 0):
                raise InputError(f"logit_bias: {entry!r}: expected (token id >= 0, bias)")
            if not (_real(bias) and lo <= bias <= hi):
                raise InputError(f"logit_bias[{token}]={bias!r}: must be a number in [{lo:g}, {hi:g}]")
            if vocab_size is not None and token >= vocab_size:
                raise InputError(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab_size})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def counts_tokens(self) -> bool:
        """Whether sampling reads how often each token was generated (presence or frequency penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def plain(self) -> bool:
        """The logits as the model gives them: no penalty and no bias (greedy is then their argmax)."""
        return self.repetition_penalty == 1.0 and not self.counts_tokens and not self.logit_bias


def apply_repetition_penalty(logits: np.ndarray, history: list[np.ndarray], penalty: float) -> np.ndarray:
    """HF/CTRL rule on each row's seen tokens: positive logits divided by the penalty, negative multiplied. A token
    seen twice is written twice with the same value, so the history needs no deduplication."""
    if penalty == 1.0:
        return logits
    logits = logits.copy()
    with np.errstate(over="ignore"):  # an extreme penalty may leave float64's range: clipped below
        for row, seen in enumerate(history):
            values = logits[row, seen]
            # finite, so max-subtraction in sample() can never make inf - inf
            logits[row, seen] = np.clip(np.where(values > 0, values / penalty, values * penalty), -1e300, 1e300)
    return logits


def apply_presence_frequency(logits: np.ndarray, counts: Sequence[np.ndarray], presence: float,
                             frequency: float) -> np.ndarray:
    """OpenAI's rule: logit[j] -= count[j] * frequency + (count[j] > 0) * presence, where count[j] is how often
    token j was generated so far in this completion (the prompt does not count). counts: per row, [vocab]."""
    if presence == 0 and frequency == 0:
        return logits
    c = np.stack(counts).astype(np.float64)  # [b, vocab]
    return logits - c * frequency - (c > 0) * presence


def apply_logit_bias(logits: np.ndarray, bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """OpenAI's logit_bias: each value added to its token's logit before sampling (ids outside the vocabulary are
    refused when the request is checked)."""
    if not bias:
        return logits
    ids, values = zip(*bias)
    logits = logits.copy()
    logits[:, list(ids)] += np.array(values, np.float64)
    return logits


def is_integer(value) -> bool:
    """An integer, Python's or numpy's; not a boolean."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | Sequence[np.random.Generator],
           history: list[np.ndarray], counts: Sequence[np.ndarray] | None = None,
           allowed: np.ndarray | None = None) -> np.ndarray:
    """logits [b, vocab] float32 -> token ids [b] int64. `rng`: one generator for every row, or one per row (a
    request's seed then draws the same tokens whichever rows share the call). In order: logit_bias, repetition
    penalty (`history`: each row's prompt and generated ids), presence and frequency penalties (`counts`: each row's
    generated-token counts [vocab]), the `allowed` mask [b, vocab] (a grammar's: the others get probability 0),
    then temperature, top-k, top-p and min-p (transformers' order)."""
    logits = adjusted_logits(logits, params, history, counts, allowed)
    if params.greedy:
        return logits.argmax(-1).astype(np.int64)
    probs = _tempered(logits, params)
    u = uniform(rng, probs.shape[0])
    if params.top_p < 1.0 or params.min_p > 0:  # draw among the kept ids only (ascending: the same cumulative order)
        tokens = []
        for row, ui in zip(probs, u[:, 0]):
            ids = kept_ids(row, params)
            kept = row[ids]  # a copy
            kept /= kept.sum()
            tokens.append(ids[draw(kept[None], np.array([[ui]]))[0]])  # a kept id of probability > 0
        return np.array(tokens, np.int64)
    return draw(probs, u)


def distribution(logits: np.ndarray, params: SamplingParams, history: list[np.ndarray],
                 counts: Sequence[np.ndarray] | None = None, allowed: np.ndarray | None = None) -> np.ndarray:
    """The probabilities [b, vocab] float64 that sample() draws from, whole: after the same penalties, bias, mask,
    temperature, top-k, top-p and min-p (0 outside the kept ids, those renormalized as sample() renormalizes them);
    greedy: 1 on the argmax. Speculative decoding's acceptance reads it (runtime.speculative)."""
    logits = adjusted_logits(logits, params, history, counts, allowed)
    if params.greedy:
        probs = np.zeros_like(logits)
        probs[np.arange(len(logits)), logits.argmax(-1)] = 1.0
        return probs
    probs = _tempered(logits, params)
    if params.top_p < 1.0 or params.min_p > 0:
        for row in probs:
            ids = kept_ids(row, params)
            kept = row[ids]
            kept /= kept.sum()
            row[:] = 0.0
            row[ids] = kept
    return probs


def draw(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draws: probs [b, vocab] (rows summing to 1, up to rounding) and uniforms u [b, 1] -> ids [b]. The
    first token whose cumulative mass reaches u; a u above a row's rounded total lands on its last token of nonzero
    probability."""
    last = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)  # [b]
    return np.minimum((np.cumsum(probs, -1) < u).sum(-1), last).astype(np.int64)


def row_generator(seed: int | None, row: int) -> np.random.Generator:
    """The random generator of a batch's row `row` (the scheduler: of a request's choice `row`): seeded by `seed`
    alone for row 0, by the row as a spawn key of the seed for the others (a stream no other seed and row give:
    numpy reads a seed [seed, row] as the 32-bit words of one integer, so seed + 2^32 row would share it); None:
    fresh entropy. Each row drawing from its own, a row that speculation gives several tokens in a step (several
    draws) leaves the others' draws where they were."""
    if seed is None or row == 0:
        return np.random.default_rng(seed)
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(row,)))


def uniform(rng: np.random.Generator | Sequence[np.random.Generator], rows: int) -> np.ndarray:
    """[rows, 1] uniforms in (0, 1): one from each row's generator, or `rows` from one. A draw of exactly 0.0 is
    raised to the smallest normal float, so it counts the leading zero-probability tokens and lands on a token that
    can be drawn (a subnormal would read as 0 on a thread with denormals-are-zero set, which onnxruntime's
    session.set_denormal_as_zero sets on the thread that creates the session)."""
    if isinstance(rng, Sequence):
        u = np.concatenate([g.random((1, 1)) for g in rng])  # one draw from each row's generator
    else:
        u = rng.random((rows, 1))
    return np.maximum(u, np.finfo(np.float64).tiny)


def unusable_rows(logits: np.ndarray) -> np.ndarray:
    """logits [b, ..., vocab] -> bool [b]: the rows with NaN or +inf at some position, or no finite value there (a
    position's max is then NaN or infinite: one reduction, not a whole isfinite mask). -inf alone is a probability
    of 0, not a fault."""
    finite_peaks = np.isfinite(logits.max(-1))  # [b, ...]
    return ~finite_peaks.all(axis=tuple(range(1, finite_peaks.ndim)))


def unusable_logits(logits: np.ndarray, where: str) -> ModelOutputError:
    """The error for logits [..., vocab] that unusable_rows flags, naming what they hold and `where` they are."""
    what = "NaN" if np.isnan(logits).any() else "infinite values"
    return ModelOutputError(
        f"the model's logits hold {what} ({where}): its weights hold non-finite values or its arithmetic overflowed "
        "(float16 compute); `mla-deploy verify EXPORT` compares the export with its source")


def finite(logits: np.ndarray) -> np.ndarray:
    """logits [b, vocab] as the model gave them, or ModelOutputError for the first unusable row: an argmax or a
    draw from it would be an arbitrary token, sampled silently."""
    bad = unusable_rows(logits)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise unusable_logits(logits[row], f"row {row} of {len(logits)}")
    return logits


def adjusted_logits(logits: np.ndarray, params: SamplingParams, history: list[np.ndarray],
                    counts: Sequence[np.ndarray] | None = None, allowed: np.ndarray | None = None) -> np.ndarray:
    """float64 logits after logit_bias, the repetition penalty, presence and frequency penalties and the mask, in
    that order (the bias first, as vLLM and transformers add it: a repetition penalty scales the biased logit):
    what greedy takes the argmax of (the model's own logits checked finite first)."""
    logits = apply_logit_bias(finite(logits).astype(np.float64), params.logit_bias)
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    if params.counts_tokens:
        logits = apply_presence_frequency(logits, counts, params.presence_penalty, params.frequency_penalty)
    if allowed is not None:
        logits = np.where(allowed, logits, -np.inf)
    return logits


def _tempered(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Adjusted logits -> probabilities after temperature and top-k (before top-p)."""
    # subtract the max first: every scaled logit is <= 0; one far below the max may scale to -inf,
    # which is exactly its probability (0), so that overflow is expected
    with np.errstate(over="ignore"):
        logits = (logits - logits.max(-1, keepdims=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = np.partition(logits, -params.top_k, axis=-1)[:, -params.top_k, None]  # [b, 1]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits)  # the max is exp(0) = 1: the sum is >= 1
    probs /= probs.sum(-1, keepdims=True)
    return probs


def kept_ids(p: np.ndarray, params: SamplingParams) -> np.ndarray:
    """p [vocab] after temperature and top-k -> the ids top-p and then min-p keep, ascending. Min-p (transformers'
    MinPLogitsWarper) keeps the ids with at least min_p x the likeliest one's probability, which the nucleus always
    holds and renormalizing leaves as it is."""
    ids = nucleus_ids(p, params.top_p) if params.top_p < 1.0 else None
    if params.min_p > 0:
        floor = params.min_p * p.max()
        ids = np.flatnonzero(p >= floor) if ids is None else ids[p[ids] >= floor]
    return ids


def nucleus_ids(p: np.ndarray, top_p: float) -> np.ndarray:
    """p [vocab] -> the kept token ids, ascending: in order of decreasing probability, ties by lower token id, every
    token with less than top_p of mass before it (the first always kept), as transformers' TopPLogitsWarper.

    A stable sort of the whole vocabulary at DeepSeek's 102400 tokens can cost more than a small model's decode
    step. The nucleus is mostly among the likeliest few (the demo model at temperature
    0.7, top_p 0.9: median 8 tokens), so the tokens likelier than a threshold t = max(p) x ratio are tried first, for
    each ratio of NUCLEUS_RATIOS: they precede every other token in the order, so their stable sort is the whole
    sort's first part and their cumulative sums are its first sums, bit for bit. Where those reach top_p, every other
    token has at least top_p before it and is dropped: the nucleus is decided exactly. Otherwise (or with more than
    NUCLEUS_MAX_CANDIDATES of them) the next ratio, then the whole vocabulary."""
    peak = p.max()
    for ratio in NUCLEUS_RATIOS:
        ids = np.flatnonzero(p > peak * ratio)  # ascending
        if len(ids) > NUCLEUS_MAX_CANDIDATES:
            break
        kept = _sorted_prefix(ids, p[ids], top_p)
        if kept is not None:
            return kept
    return _sorted_prefix(np.arange(len(p)), p, top_p, whole=True)


def _sorted_prefix(ids: np.ndarray, p: np.ndarray, top_p: float, whole: bool = False) -> np.ndarray | None:
    """ids (ascending) and their probabilities -> the kept ids, ascending; None where their mass (summed in the
    sorted order, as the whole sort sums it) stays below top_p and the rest of the vocabulary (`whole` False)
    may hold more of the nucleus."""
    order = np.argsort(-p, kind="stable")  # descending, ties by id (ids ascending)
    p, ids = p[order], ids[order]
    total = np.cumsum(p)
    if not whole and total[-1] < top_p:
        return None
    return np.sort(ids[total - p < top_p])  # mass strictly before each token below top_p
