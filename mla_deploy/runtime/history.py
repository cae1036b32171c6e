"""A row's token history (prompt and output ids), grown one token at a time. Its readers (repetition penalties,
prompt lookup, acceptance) take it as an array; appending writes into a buffer that doubles when full, where
`np.append` would copy the whole row every token. numpy only."""

from __future__ import annotations

import numpy as np

SMALLEST = 64  # slots of a row's first buffer


def appended(history: np.ndarray, buffer: np.ndarray | None, token: int) -> tuple[np.ndarray, np.ndarray]:
    """(`history` and then `token`, the buffer that is a view of). `buffer`: the one `history` is the first slots
    of, as this returned it (None: `history` is an array of its own, copied into a fresh buffer). Earlier views
    stay as they were: slots they hold are never written again."""
    n = len(history)
    if buffer is None or n == len(buffer):
        grown = np.empty(max(2 * n, SMALLEST), np.int64)
        grown[:n] = history
        buffer = grown
    buffer[n] = token
    return buffer[: n + 1], buffer
