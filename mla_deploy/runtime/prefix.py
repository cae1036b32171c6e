"""Prefix caching: a new prompt starts from cache slots a row already holds for the same leading tokens.

A scheduler row's latent cache keeps, after its request ends, the entries of every token it ran: slot i holds c_kv
and k_pe of token i, which depend on tokens 0..i alone. A later prompt that begins with those tokens (the next turn
of a chat: the previous prompt and reply, then the new message; a shared system prompt; a few-shot preamble) needs
those slots again, so the scheduler reuses them in place, or copies them from another row, and prefills only the
rest, as llama.cpp's server does per slot and vLLM's automatic prefix caching does per block.

The prompt's last token is always run (its logits sample the first token). With the MTP draft, the reused slots
stop one short of the common prefix, so the draft's pair at the last reused slot (h_i, t_{i+1}) names the new
prompt's token. A request for its prompt's logprobs (lm-eval's scoring: `echo` with `max_tokens: 0`) reuses a row
that kept those of its own prompt, with as many alternatives each: the positions before the reused slots take the
row's entries (position i scores token i + 1, so they stop one short of the common prefix too), the rest are
computed by the prefill.

A reused slot may hold numbers computed in another chunking (a reply decoded token by token) than a fresh
prefill's: equal within float rounding, not bit for bit, as in vLLM; the scheduler's `prefix_caching=False` gives a
prompt's numbers independent of what ran before.

Cache reuse past the common start (the scheduler's `cache_reuse`, off by default; llama.cpp's server calls it
`--cache-reuse`): a prompt that drops tokens from the middle of what a row holds (a chat's oldest turns, dropped to
leave room in the context) continues with runs of the row's later tokens. Those slots move left to where the prompt
has them, and their roped keys rotate by the same number of positions (rope.shifted_keys); the latent c_kv carries
no position, so it moves as it is, which is what makes this cheap for MLA. A moved slot still holds what its token
computed while it saw the dropped tokens: an approximation of a fresh prefill (the common start's slots stay exact),
which is why it is asked for, and only runs of at least `cache_reuse` tokens move.
numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

NONE = np.zeros(0, np.int64)  # a row holding nothing


def common_length(prompt: np.ndarray, held: np.ndarray) -> int:
    """How many leading tokens `prompt` and `held` share."""
    n = min(len(prompt), len(held))
    differ = np.flatnonzero(prompt[:n] != held[:n])
    return int(differ[0]) if len(differ) else n


def held_tokens(prompt_ids: list[int], generated: list[int], length: int) -> np.ndarray:
    """The tokens whose entries a request's row holds in slots [0, length): its prompt, then its output (its last
    sampled token is not in the cache yet; a verification pass may have written drafts past its stop token, which
    are not the request's)."""
    tokens = prompt_ids[:length]
    if length > len(prompt_ids):
        tokens = tokens + generated[: length - len(prompt_ids)]
    return np.asarray(tokens, np.int64)


def reusable_slots(prompt: np.ndarray, held: np.ndarray, draft_written: int | None = None,
                   scored: int | None = None) -> int:
    """The slots of a row holding `held` that a new `prompt` can start from: the common prefix, less the prompt's
    last token (run for its logits); with the MTP draft (`draft_written`: the row's committed draft pairs), one
    short of the common prefix and no further than the draft's pairs reach. For a prompt whose logprobs are asked
    for (`scored`: how many of the row's prompt positions have theirs, position j's being token j + 1's), one short
    of the common prefix too, and no further than those: the positions before the reused slots take the row's."""
    common = common_length(prompt, held)
    slots = min(common, len(prompt) - 1)
    for limit in (draft_written, scored):
        if limit is not None:
            slots = min(slots, common - 1, limit)
    return max(slots, 0)


@dataclass(frozen=True)
class Moved:
    """A run of slots a prompt reuses at another place: the row's slots [start, start + length) become the prompt's
    [to, to + length), their keys moved by to - start positions (to <= start: tokens before them were dropped)."""
    start: int
    to: int
    length: int


def moved_runs(prompt: np.ndarray, held: np.ndarray, reused: int, least: int) -> list[Moved]:
    """Past the `reused` slots of the common start: the runs of at least `least` of `held`'s later tokens that
    continue `prompt`, in order, each the first such run after the one before it (llama.cpp server's scan for
    `--cache-reuse`). The prompt positions they fill are [reused, reused + their total): the prefill goes on from
    there. The prompt's last token is never reused (its logits sample the first token)."""
    runs: list[Moved] = []
    to, start, end = reused, reused, len(prompt) - 1
    while to + least <= end:
        found = _first_run(held, start, prompt[to : to + least])
        if found is None:
            break
        length = least + common_length(prompt[to + least : end], held[found + least :])
        runs.append(Moved(found, to, length))
        to, start = to + length, found + length
    return runs


def moved_tokens(runs: list[Moved]) -> int:
    """The prompt tokens `runs` fill."""
    return sum(run.length for run in runs)


SEARCH_BLOCK = 4096  # held positions compared per step of a run's search: the cost follows the distance to the run


def _first_run(held: np.ndarray, start: int, tokens: np.ndarray) -> int | None:
    """The first position from `start` where `held` holds `tokens`, or None."""
    least = len(tokens)
    while start + least <= len(held):
        stop = min(len(held), start + SEARCH_BLOCK + least - 1)
        windows = sliding_window_view(held[start:stop], least)  # [stop - start - least + 1, least], no copy
        hits = np.flatnonzero((windows == tokens).all(axis=1))
        if len(hits):
            return start + int(hits[0])
        start = stop - least + 1
    return None
