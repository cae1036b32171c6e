"""The MTP draft graph at run time: DeepSeek-V3's multi-token-prediction module proposing tokens for speculative
decoding (runtime.speculative), over its own one-layer latent cache. onnxruntime + numpy only.

Slot i of the draft's cache holds the pair (h_i, t_{i+1}): the main model's final hidden state at i and the token
after it. The pairs are written as the main model commits tokens: after each prefill chunk, the chunk's positions
whose next token is in the prompt (`prefill`); then, before each step's drafting, the pairs from the row's last
position to its newest token (`propose`'s catch-up of what `commit` collected: after a prefill, the last prompt
position and the first token; after a verification pass, the accepted drafts and the token drawn after them, whose
hidden states the pass returned; after a plain step, the one token; after steps the row drafted nothing in, all of
them), overwriting what the previous step's chained drafts wrote there. The
catch-up's last position predicts the first draft token; the draft then chains on its own hidden state (the one its
head read) for the next ones.
"""

from __future__ import annotations

import numpy as np

from .. import io_spec
from .cache import CacheBuffers

MAX_DRAFT_TOKENS = 16  # the most tokens a pass drafts (runtime.speculative's bound): chained drafts' spare slots


class MTPDrafter:
    """The export's draft graph over its own cache rows [0, batch)."""

    def __init__(self, model, batch: int):
        model.load(io_spec.DRAFT)
        self.model, self.session = model, model.sessions[io_spec.DRAFT]
        cfg = model.config
        # Room for padding past the export's length: a call writes every row's slots from its own start to the widest
        # row's catch-up (and its chained drafts after it), so a row near the end, or one whose request ended there
        # and that now rides along, pads beyond the last position, by at most a catch-up (<= max_seq_len) and the
        # chained drafts (< MAX_DRAFT_TOKENS). No real query reaches those slots: each sees the slots up to its own.
        self.caches = CacheBuffers(cfg, batch, 1, 2 * model.max_seq_len + MAX_DRAFT_TOKENS, model.device,
                                   model.cache_format, layers=io_spec.draft_layers(cfg), resident=model.resident_caches)
        # per row, what the next catch-up feeds: tokens [n], the main hidden states before them [n, d], and the draft
        # position of the first
        self.catch: list[tuple[np.ndarray, np.ndarray, int] | None] = [None] * batch
        self._prompt_end: dict[int, tuple[np.ndarray, int]] = {}  # row -> its last prompt position's state, position
        self.written = np.zeros(batch, np.int64)  # per row: slots [0, written) hold committed pairs

    def reset(self, row: int) -> None:
        """A new request in `row`."""
        self.catch[row] = None
        self._prompt_end.pop(row, None)
        self.written[row] = 0

    def reuse(self, row: int, source: int, slots: int) -> None:
        """A new request in `row` that starts from the first `slots` committed pairs of row `source` (prefix caching,
        runtime.prefix; copied when source is another row)."""
        self.reset(row)
        if source != row:
            self.caches.copy_slots(source, row, slots)
        self.written[row] = slots

    def run(self, ids: np.ndarray, hidden: np.ndarray, starts: np.ndarray, last: np.ndarray,
            first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """ids [b, T] (tokens i + 1) and hidden [b, T, d] (states at i) for cache rows first_row .. first_row + b,
        written from draft positions `starts` [b]; returns the logits [b, vocab] and the normed hidden state [b, d]
        at each row's chunk position last[b]."""
        b, t = ids.shape
        self.caches.ensure(int(starts.max()) + t)
        binding = self.session.io_binding()
        binding.bind_cpu_input(io_spec.INPUT_IDS, np.ascontiguousarray(ids, np.int64))
        positions = np.minimum(starts[:, None] + np.arange(t), self.model.max_seq_len - 1)  # padding may run past
        binding.bind_cpu_input(io_spec.POSITION_IDS, positions.astype(np.int64))
        binding.bind_cpu_input(io_spec.ATTENTION_MASK, np.ones((b, self.caches.capacity), np.int64))
        binding.bind_cpu_input(io_spec.WRITE_INDICES, starts.astype(np.int64))
        binding.bind_cpu_input(io_spec.LOGITS_POSITIONS, last.astype(np.int64)[:, None])
        binding.bind_cpu_input(io_spec.PREVIOUS_HIDDEN, np.ascontiguousarray(hidden, np.float32))
        binding.bind_output(io_spec.LOGITS, "cpu")
        binding.bind_output(io_spec.HIDDEN, "cpu")
        rows = None if (first_row, b) == (0, self.caches.batch) else slice(first_row, first_row + b)
        views = self.caches.bind(binding, rows)
        self.session.run_with_iobinding(binding)
        del views
        logits, state = (v.numpy()[:, 0] for v in binding.get_outputs()[:2])
        return logits, state

    def prefill(self, hidden: np.ndarray, start: int, next_ids: np.ndarray, first_row: int = 0) -> None:
        """After a main prefill chunk at positions start ..: hidden [b, t, d] the main model's states there, next_ids
        [b, t] the prompt token after each position (-1 where the prompt has none: from the row's last position on,
        whose pair waits for the first generated token). Writes the pairs that are known."""
        known = next_ids >= 0
        if not known.any():
            return
        t = int(known.sum(-1).max())
        b = next_ids.shape[0]
        self.run(np.where(known, next_ids, 0)[:, :t], hidden[:, :t], np.full(b, start, np.int64), np.zeros(b, np.int64),
                 first_row)
        self.written[first_row : first_row + b] = np.maximum(self.written[first_row : first_row + b],
                                                              start + known.sum(-1))

    def prompt_done(self, row: int, hidden: np.ndarray, position: int) -> None:
        """A row's prompt is prefilled: `hidden` [1, d] at its last `position`, whose pair waits for the first token."""
        self._prompt_end[row] = (hidden, position)

    def first_token(self, row: int, token: int) -> None:
        hidden, position = self._prompt_end.pop(row)
        self.commit(row, np.array([token]), hidden, position)

    def commit(self, row: int, tokens: np.ndarray, hidden: np.ndarray, start: int) -> None:
        """The main model committed `tokens` [n] at positions start .. with its hidden states before each [n, d]: the
        row's next catch-up feeds them, after what it has not yet fed (a row that drafted nothing in between)."""
        waiting = self.catch[row]
        if waiting is None:
            self.catch[row] = (np.asarray(tokens), np.asarray(hidden), start)
        else:
            self.catch[row] = (np.concatenate([waiting[0], tokens]), np.concatenate([waiting[1], hidden]), waiting[2])

    def propose(self, rows: range, rooms: list[int]) -> list[np.ndarray]:
        """Draft up to rooms[i] tokens for each of rows [rows.start, rows.stop): the draft's argmax, token after token
        (a deterministic proposal: runtime.speculative), after catching each drafting row up. A row with no room
        takes no part (its catch-up waits for its next draft: `commit` adds to it), and without any the draft does
        not run."""
        b = len(rows)
        k = max(rooms, default=0)
        drafts = np.zeros((b, k), np.int64)
        if k == 0:
            return [drafts[i, :0] for i in range(b)]
        d = self.model.config.hidden_size
        catch = []
        for i, r in enumerate(rows):
            if rooms[i] and self.catch[r] is not None:
                catch.append(self.catch[r])
                self.catch[r] = None  # consumed: the next commit starts the next catch-up
                self.written[r] = catch[-1][2] + len(catch[-1][0])
            else:  # riding along: one pad pair at its first slot without a committed pair (rewritten later)
                catch.append((np.zeros(1, np.int64), np.zeros((1, d), np.float32), int(self.written[r])))
        width = max(len(t) for t, _, _ in catch)
        ids = np.zeros((b, width), np.int64)
        states = np.zeros((b, width, d), np.float32)
        for i, (t, h, _) in enumerate(catch):
            ids[i, : len(t)], states[i, : len(t)] = t, h
        lengths = np.array([len(t) for t, _, _ in catch], np.int64)
        starts = np.array([s for _, _, s in catch], np.int64)
        logits, state = self.run(ids, states, starts, lengths - 1, rows.start)
        for j in range(k):
            drafts[:, j] = logits.argmax(-1)
            if j + 1 < k:
                logits, state = self.run(drafts[:, j : j + 1], state[:, None], starts + lengths + j,
                                         np.zeros(b, np.int64), rows.start)
        return [drafts[i, : rooms[i]] for i in range(b)]
