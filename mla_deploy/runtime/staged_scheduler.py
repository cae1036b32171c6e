"""Continuous batching over a staged export's stages (runtime.chain in this process, runtime.stages as Ray actors):
the Scheduler's requests, checks, sampling and events, with the caches held by the stages and the rows split into
groups that are in flight together (pipeline parallelism), as runtime.pipeline does for one generation.

The rows [0, max_batch) are cut into `micro_batches` contiguous groups (default: one per stage), each a cache group
of its rows on every stage; a request goes to the group running the fewest. A step, for each group in turn:
  1. collects what the group launched the step before, in launch order: a prefill chunk's logits (the prompt's
     logprobs, its first token), a decode's logits (each row's token, sampled here as in the Scheduler);
  2. launches its next operations: prefill chunks of its prompts (batch-1, into the row's slice, from multiples of
     `prefill_chunk` as in the Scheduler, about one chunk's worth a step), then one decode of its rows up to its
     highest occupied one, the rows that are not decoding riding along with a pad token at their own length.
Launching returns at once on Ray (an object ref), so while the driver samples one group's tokens the stages run the
others' steps: stage 2 one group's while stage 1 the next's. In this process (StageChain) a launch runs at once.

A request finished or cancelled while its group's step is in flight is dropped from that step's results when they
arrive (they are matched by request, not by row); a stage that fails raises StageFailedError out of step(), which
the Engine hands to every request and to /health. A staged export holds no verify or draft graph: no speculation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import io_spec
from ..errors import InputError
from .scheduler import Request, Scheduler
from .speculative import Speculation

_keys = itertools.count()


@dataclass
class _Launched:
    kind: str  # io_spec.PREFILL or io_spec.DECODE
    requests: list[Request]  # a prefill chunk's one request, or the rows a decode advanced
    handle: object  # the stage chain's handle of the last stage's logits
    start: int = 0  # a prefill chunk's first prompt token
    tokens: int = 0  # and its length


@dataclass
class _Group:
    key: str  # its cache group on every stage
    lo: int  # rows [lo, hi)
    hi: int
    launched: list[_Launched] = field(default_factory=list)


class StagedScheduler(Scheduler):
    def __init__(self, model, max_batch: int = 16, max_queue: int = 256, prefill_chunk: int = 256,
                 speculation: Speculation | None = None, micro_batches: int | None = None):
        """`model`: a stage chain (runtime.chain.StageChain, runtime.stages.StagedModel); `micro_batches`: groups of
        rows in flight together (default: one per stage, at most max_batch)."""
        if speculation is not None and speculation.mode not in ("off", "auto"):
            raise InputError(f"speculative={speculation.mode!r}: a staged export has no verify graph to speculate "
                             "with; serve it without --speculative")
        self._rows_and_queue(model, max_batch, max_queue, prefill_chunk)
        self.speculation, self.drafter, self.drafts_pay = Speculation(), None, False
        count = len(model.stage_dirs) if micro_batches is None else micro_batches
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise InputError(f"micro_batches={micro_batches!r}: must be a positive integer")
        parts = np.array_split(np.arange(max_batch), min(count, max_batch))
        self.groups = [_Group(f"serve-{next(_keys)}", int(p[0]), int(p[-1]) + 1) for p in parts]
        for group in self.groups:
            model.open(group.key, group.hi - group.lo)

    def has_work(self) -> bool:
        return super().has_work() or any(g.launched for g in self.groups)

    def step(self, after_phase: Callable[[], None] = lambda: None) -> None:
        self.stats.steps += 1
        self._drop_cancelled()
        self._admit()
        for group in self.groups:
            launched, group.launched = group.launched, []
            for op in launched:
                self._collect(group, op)
            if launched:
                after_phase()
            self._launch(group)

    def _place(self, request: Request, held: dict) -> tuple[int, int, int, list]:
        """The lowest free row of the group running the fewest requests (the first such group), prefilled whole (no
        prefix caching here): at low load every group carries some, so the stages run one group's step while the
        driver samples another's (the lowest free row overall would put them all in the first group)."""
        group = min((g for g in self.groups if None in self.rows[g.lo:g.hi]),
                    key=lambda g: sum(r is not None for r in self.rows[g.lo:g.hi]))
        row = self.rows.index(None, group.lo, group.hi)
        return row, row, 0, []

    def _clear_row(self, row: int) -> None:
        """Row `row`'s slots zeroed on every stage, which hold the caches (runtime.chain, runtime.stages): after its
        group's launched steps, before any later one."""
        group = next(g for g in self.groups if g.lo <= row < g.hi)
        self.model.clear_row(group.key, row - group.lo)

    def close(self) -> None:
        """Free every group's caches on the stages."""
        for group in self.groups:
            self.model.close(group.key)

    # ---- launching ----
    def _launch(self, group: _Group) -> None:
        for request, t in self._chunks(self.rows[group.lo:group.hi]):
            self._launch_chunk(group, request, t)
        decoding = [r for r in self.rows[group.lo:group.hi] if r is not None and r.pending is not None]
        if decoding:
            self._launch_decode(group, decoding)

    def _launch_chunk(self, group: _Group, request: Request, t: int) -> None:
        start, row = request.prefilled, request.row
        ids = np.asarray(request.prompt_ids[start:start + t], np.int64)[None]  # [1, t]
        positions = np.arange(start, start + t, dtype=np.int64)[None]
        # logits of every position where the prompt's logprobs are asked for, else of the last: [1, n, vocab]
        wanted = np.arange(t, dtype=np.int64)[None] if request.prompt_logprobs is not None else np.array([[t - 1]])
        handle = self.model.forward(group.key, io_spec.PREFILL, ids, positions, np.array([start], np.int64), wanted,
                                    (row - group.lo, row - group.lo + 1))
        request.prefilled += t
        self.lengths[row] = request.prefilled
        group.launched.append(_Launched(io_spec.PREFILL, [request], handle, start, t))

    def _launch_decode(self, group: _Group, decoding: list[Request]) -> None:
        n = max(r.row for r in decoding) + 1 - group.lo
        ids = np.zeros((n, 1), np.int64)  # pad rows
        for r in decoding:
            ids[r.row - group.lo, 0] = r.pending
        # a pad row writes its token at its own length: a row whose prompt filled the export (a score-only request,
        # its prefill not collected yet) pads at the last slot, which no later prompt reuses (no prefix caching
        # here); a decoding row's length is below it (its pending token has a slot)
        lengths = np.minimum(self.lengths[group.lo:group.lo + n], self.model.max_seq_len - 1)
        handle = self.model.forward(group.key, io_spec.DECODE, ids, lengths[:, None], lengths, None, (0, n))
        for r in decoding:
            self.lengths[r.row] += 1
            r.pending = None  # in the cache once the decode runs; its successor is sampled when the logits arrive
        group.launched.append(_Launched(io_spec.DECODE, decoding, handle))

    # ---- collecting ----
    def _collect(self, group: _Group, op: _Launched) -> None:
        logits = self.model.resolve(op.handle)
        live = [r for r in op.requests if r.row is not None]  # not finished or cancelled meanwhile
        if op.kind == io_spec.PREFILL:
            if live:
                self._chunk_done(live[0], op.start, op.tokens, logits)
            return
        self.stats.decode_steps += 1
        self.stats.decoded_rows += len(live)
        chosen = self._choose(live, logits, group.lo)  # logits [rows from lo, vocab]
        for r in (r for r in live if r.id in chosen):  # the others failed (their logits unusable)
            row = r.row - group.lo
            self._sample_and_emit(r, logits[row:row + 1], chosen[r.id])
