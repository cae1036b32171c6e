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
prompt's numbers independent of what ran before. numpy only.
"""

from __future__ import annotations

import numpy as np

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
