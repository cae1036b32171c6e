"""Sampling options in one dataclass, and pure numpy sampling from logits."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InputError


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
    """HF/CTRL rule on each row's seen tokens: positive logits divided by the penalty, negative multiplied."""
    if penalty == 1.0:
        return logits
    logits = logits.copy()
    with np.errstate(over="ignore"):  # an extreme penalty may leave float64's range: clipped below
        for row, seen in enumerate(history):
            seen = np.unique(seen)
            values = logits[row, seen]
            logits[row, seen] = np.where(values > 0, values / penalty, values * penalty)
    return np.clip(logits, -1e300, 1e300)  # finite, so max-subtraction below can never make inf - inf


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, history: list[np.ndarray]) -> np.ndarray:
    """logits [b, vocab] float32 -> token ids [b] int64."""
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
        order = np.argsort(-probs, axis=-1, kind="stable")  # [b, vocab] descending
        sorted_probs = np.take_along_axis(probs, order, -1)
        before = np.cumsum(sorted_probs, -1) - sorted_probs  # mass strictly above each token
        keep_sorted = before < params.top_p  # the smallest prefix reaching top_p (the first always kept)
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum(-1, keepdims=True)
    u = rng.random((probs.shape[0], 1))
    return np.minimum((np.cumsum(probs, -1) < u).sum(-1), probs.shape[-1] - 1).astype(np.int64)
