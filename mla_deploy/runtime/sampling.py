"""Sampling options in one dataclass, and pure numpy sampling from logits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError

NUCLEUS_CANDIDATES = (64, 512)  # top-p looks for the nucleus among this many likeliest tokens first (nucleus())


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1: no nucleus filter
    repetition_penalty: float = 1.0  # 1: off; >1 discourages tokens already in the sequence
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise InputError(f"temperature={self.temperature!r}: must be a finite number >= 0 (0 is greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise InputError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 disables it)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InputError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not (isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
                and self.repetition_penalty > 0):
            raise InputError(f"repetition_penalty={self.repetition_penalty!r}: must be a finite number > 0")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InputError(f"seed={self.seed!r}: must be a non-negative integer")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | Sequence[np.random.Generator],
           history: list[np.ndarray]) -> np.ndarray:
    """logits [b, vocab] float32 -> token ids [b] int64. `rng`: one generator for every row, or one per row (a
    request's seed then draws the same tokens whichever rows share the call)."""
    logits = apply_repetition_penalty(logits.astype(np.float64), history, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(-1).astype(np.int64)
    # subtract the max first: every scaled logit is <= 0; one far below the max may scale to -inf,
    # which is exactly its probability (0), so that overflow is expected
    with np.errstate(over="ignore"):
        logits = (logits - logits.max(-1, keepdims=True)) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = np.partition(logits, -params.top_k, axis=-1)[:, -params.top_k, None]  # [b, 1]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits)  # the max is exp(0) = 1: the sum is >= 1
    probs /= probs.sum(-1, keepdims=True)
    if params.top_p < 1.0:
        probs = np.where(nucleus(probs, params.top_p), probs, 0.0)
        probs /= probs.sum(-1, keepdims=True)
    # a draw of exactly 0.0 counts the leading zero-probability tokens, so it too lands on a token that can be drawn
    if isinstance(rng, Sequence):
        u = np.concatenate([g.random((1, 1)) for g in rng])  # [b, 1]: one draw from each row's generator
    else:
        u = rng.random((probs.shape[0], 1))
    u = np.maximum(u, np.finfo(np.float64).smallest_subnormal)
    return np.minimum((np.cumsum(probs, -1) < u).sum(-1), probs.shape[-1] - 1).astype(np.int64)


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """probs [b, vocab] -> keep [b, vocab] bool: in order of decreasing probability, ties by lower token id, every
    token with less than top_p of mass before it (the first always kept), as transformers' TopPLogitsWarper.

    A stable sort of the whole vocabulary costs ~0.2 ms a row (4096 tokens), more than a small model's decode step.
    The nucleus is mostly among the likeliest few (the demo model at temperature 0.7, top_p 0.9: median 8 tokens,
    79 % within 63): the m likeliest, for each m of NUCLEUS_CANDIDATES in turn, are found by a partition, and the
    tokens strictly likelier than the last of them are the same set whichever of its ties the partition took.
    Where their mass reaches top_p, every other token has at least that much before it, so the nucleus lies within
    them and their sorted order (the same prefix of the same order, the same cumulative sums) decides it exactly.
    Rows whose nucleus is not within the largest candidates sort the whole vocabulary."""
    keep = np.zeros(probs.shape, bool)
    rows = np.arange(probs.shape[0])
    for m in NUCLEUS_CANDIDATES:
        if m >= probs.shape[-1] or not len(rows):
            break
        candidates = np.argpartition(-probs[rows], m - 1, axis=-1)[:, :m]  # [r, m]
        p = np.take_along_axis(probs[rows], candidates, -1)
        likelier = p > p.min(-1, keepdims=True)
        within = np.where(likelier, p, 0.0).sum(-1) >= top_p
        if within.any():
            ids, p, likelier = candidates[within], p[within], likelier[within]
            order = np.lexsort((ids, np.where(likelier, -p, np.inf)), axis=-1)  # by probability, then id
            p, ids, likelier = (np.take_along_axis(a, order, -1) for a in (p, ids, likelier))
            before = np.cumsum(np.where(likelier, p, 0.0), -1) - p  # mass strictly before each token
            keep[rows[within][:, None], ids] = likelier & (before < top_p)
        rows = rows[~within]
    if len(rows):
        order = np.argsort(-probs[rows], axis=-1, kind="stable")  # [r, vocab] descending, ties by id
        sorted_probs = np.take_along_axis(probs[rows], order, -1)
        before = np.cumsum(sorted_probs, -1) - sorted_probs  # mass strictly above each token
        keep[rows[:, None], order] = before < top_p  # the smallest prefix reaching top_p (the first always kept)
    return keep
