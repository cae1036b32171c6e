"""Scoring text through the prefill graph: per-token log-likelihood, loss and perplexity. Torch-free.

Text is cut into non-overlapping windows of `window` + 1 tokens; each window is scored from an
empty cache (its first token predicts the second, and so on), several windows per graph run.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import io_spec
from ..errors import InputError
from .feeds import prefill_feed
from .session import ExportedModel


def windows(ids: list[int], window: int) -> np.ndarray:
    """[n_windows, window + 1] token ids; the tail that does not fill a window is dropped."""
    if window < 1:
        raise InputError(f"window={window}: must be positive")
    n = (len(ids) - 1) // window
    if n < 1:
        raise InputError(f"text has {len(ids)} tokens; scoring needs at least {window + 1}")
    return np.array([ids[i * window : i * window + window + 1] for i in range(n)], np.int64)


def log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """logits [..., vocab], targets [...] -> negative log-likelihood [...] in float64."""
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    return log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def export_scores(model: ExportedModel, batch: np.ndarray, rows_per_run: int = 8,
                  on_run: Callable[[int], None] = lambda done: None) -> tuple[np.ndarray, np.ndarray]:
    """NLL of each next token of each window and the export's top-1 prediction there: [n_windows, window] each.
    `on_run(windows done)` after each graph run."""
    cfg = model.config
    out, top1 = [], []
    for start in range(0, len(batch), rows_per_run):
        w = batch[start : start + rows_per_run]
        t = w.shape[1] - 1
        if t > model.max_seq_len:
            raise InputError(f"window {t} exceeds the export's maximum length {model.max_seq_len}")
        logits = model.run(io_spec.PREFILL, prefill_feed(cfg, w[:, :-1], cache_dtype=model.cache_dtype))[io_spec.LOGITS]  # [b, t, vocab]
        out.append(log_softmax_nll(logits, w[:, 1:]))
        top1.append(logits.argmax(-1))
        on_run(start + len(w))
    return np.concatenate(out), np.concatenate(top1)
