"""Scoring text through the prefill graph: per-token log-likelihood, loss and perplexity. Torch-free.

Text is cut into non-overlapping windows of `window` + 1 tokens (the last one shorter where the text does not fill
it: every token but the first is scored); each window is scored from an empty cache (its first token predicts the
second, and so on), several windows of one length per graph run.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import io_spec
from ..errors import InputError
from .feeds import prefill_feed
from .session import ExportedModel


def windows(ids: list[int], window: int) -> list[np.ndarray]:
    """Windows of `window` + 1 token ids, consecutive windows sharing one token (the last one predicts the next
    window's first), so every token after the first is predicted exactly once; the last window holds what is left
    (at least two tokens)."""
    if window < 1:
        raise InputError(f"window={window}: must be positive")
    if len(ids) < 2:
        raise InputError(f"{len(ids)} token{'' if len(ids) == 1 else 's'} to score; scoring needs at least 2")
    return [np.array(ids[start : start + window + 1], np.int64) for start in range(0, len(ids) - 1, window)]


NLL_ROWS = 64  # positions whose log-normalizers are taken at once: float64 temporaries of [64, vocab]
LOGITS_BUDGET = 512 * 2**20  # bytes of float32 logits one graph run may return ([windows, window, vocab])


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits [..., vocab], targets [...] -> negative log-likelihood [...] in float64, NLL_ROWS positions at a time
    (a whole [8, 256, 102400] batch in float64 would hold several GB of temporaries)."""
    flat, wanted = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    nll = np.empty(len(flat), np.float64)
    for start in range(0, len(flat), NLL_ROWS):
        rows = flat[start : start + NLL_ROWS].astype(np.float64)
        top = rows.max(-1, keepdims=True)
        log_z = np.log(np.exp(rows - top).sum(-1)) + top[:, 0]
        nll[start : start + NLL_ROWS] = log_z - rows[np.arange(len(rows)), wanted[start : start + NLL_ROWS]]
    return nll.reshape(targets.shape)


def runs_of(window: int, vocab: int, most: int = 8) -> int:
    """Windows per graph run: up to `most`, fewer where their logits would pass LOGITS_BUDGET (one at least)."""
    return max(1, min(most, LOGITS_BUDGET // (window * vocab * 4)))


def export_scores(model: ExportedModel, batch: list[np.ndarray], rows_per_run: int | None = None,
                  on_run: Callable[[int], None] = lambda done: None) -> tuple[np.ndarray, np.ndarray]:
    """NLL of each next token of each window and the export's top-1 prediction there, window after window in one
    array each (len(w) - 1 per window w). `rows_per_run`: windows per graph run (default runs_of the longest).
    `on_run(windows done)` after each graph run."""
    cfg = model.config
    out, top1 = [], []
    if rows_per_run is None:
        rows_per_run = runs_of(max(len(w) for w in batch) - 1, cfg.vocab_size) if batch else 1
    for start in range(0, len(batch), rows_per_run):
        runs = batch[start : start + rows_per_run]
        for length in dict.fromkeys(len(w) for w in runs):  # a run's windows share a length (the last may not)
            w = np.stack([r for r in runs if len(r) == length])
            t = length - 1
            if t > model.max_seq_len:
                raise InputError(f"window {t} exceeds the export's maximum length {model.max_seq_len}")
            feed = prefill_feed(cfg, w[:, :-1], cache_dtype=model.cache_format)
            logits = model.run(io_spec.PREFILL, feed)[io_spec.LOGITS]  # [b, t, vocab]
            out.append(log_softmax_nll(logits, w[:, 1:]).reshape(-1))
            top1.append(logits.argmax(-1).reshape(-1))
        on_run(start + len(runs))
    return np.concatenate(out), np.concatenate(top1)
