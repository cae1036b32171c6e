"""Generation over a staged export's stages (runtime.chain in this process, runtime.stages as Ray actors), with the
rows split into micro-batches that are in flight together: while the last stage decodes one micro-batch, the first
runs the next (pipeline parallelism). The driver samples; the stages hold the caches.

A stage chain offers forward(key, kind, new, positions, write, logits_positions) -> handle, resolve(handle) ->
logits [b, vocab] and close(key); on Ray a handle is an object ref, so a step's hidden states pass from one stage's
actor to the next without coming back here, and the driver waits only for the logits.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Generator as Generator_
from typing import Sequence

import numpy as np

from .. import io_spec
from ..errors import InputError
from .generator import (GenerationResult, StepOutput, check_ended_row, check_first_allowed, check_prompts,
                        check_settings, check_stop_token_ids, run_to_end)
from .history import appended
from .sampling import SamplingParams, row_generator, sample

_keys = itertools.count()


@dataclass
class _MicroBatch:
    key: str
    rows: list[int]  # their indices among the prompts
    lengths: np.ndarray  # [b] tokens held in each row's caches
    history: list[np.ndarray]
    history_buffers: list[np.ndarray | None]  # the buffer each row's history views (runtime.history)
    rng: list[np.random.Generator]  # a row's own (sampling.row_generator, by its index among the prompts)
    counts: list[np.ndarray] | None
    finished: np.ndarray
    stopped_before: np.ndarray | None = None  # the rows that had finished before the latest step
    steps: int = 0  # tokens sampled so far per row
    handle: object = None  # the step in flight: its logits once resolved


class PipelineGenerator:
    """Generates from a stage chain (runtime.chain.StageChain, runtime.stages.StagedModel) as Generator does from an
    ExportedModel: the same prompts' checks, sampling and stop tokens, the same GenerationResult."""

    def __init__(self, model, sampling: SamplingParams | None = None, stop_token_ids: Sequence[int] | None = None,
                 micro_batches: int = 1):
        """`micro_batches`: how many groups of rows are in flight at once (one per stage keeps every stage busy)."""
        self.model = model
        check_settings(sampling, None)
        self.sampling = (model.generation.sampling if sampling is None else sampling).validate(model.config.vocab_size)
        if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
            raise InputError(f"micro_batches={micro_batches!r}: must be a positive integer")
        self.micro_batches = micro_batches
        self.stop_token_ids = set(model.stop_token_ids if stop_token_ids is None
                                  else check_stop_token_ids(stop_token_ids, model.config.vocab_size))

    def generate(self, prompts, max_new_tokens: int, first_allowed: np.ndarray | None = None) -> GenerationResult:
        return run_to_end(self.stream(prompts, max_new_tokens, first_allowed))

    def check_prompts(self, prompts, max_new_tokens: int) -> list[list[int]]:
        return check_prompts(prompts, max_new_tokens, self.model.config.vocab_size, self.model.max_seq_len)

    def stream(self, prompts, max_new_tokens: int,
               first_allowed: np.ndarray | None = None
               ) -> Generator_[StepOutput, Sequence[int] | None, GenerationResult]:
        """Yield each micro-batch's step as its tokens arrive (None for the rows of the others and finished ones);
        the iterator's return value is the GenerationResult. Closing it early frees every stage's caches.
        first_allowed, and `send(rows)` to end rows at the step just yielded: as Generator.stream's (a row sent
        must be one of the step's)."""
        rows = self.check_prompts(prompts, max_new_tokens)
        first_allowed = check_first_allowed(first_allowed, len(rows), self.model.config.vocab_size)
        generated: list[list[int]] = [[] for _ in rows]
        reasons = ["length"] * len(rows)
        groups = []
        t0 = time.perf_counter()
        prefill_ms, decode_tokens = None, 0
        try:
            for part in np.array_split(np.arange(len(rows)), min(self.micro_batches, len(rows))):
                groups.append(self._start(part, rows))
            active = list(groups)
            while active:
                for group in list(active):  # each in turn: the others' steps run on the stages meanwhile
                    logits = self.model.resolve(group.handle)
                    tokens = self._sample(group, logits, generated, reasons,
                                          None if first_allowed is None or group.steps else first_allowed[group.rows])
                    out: list[int | None] = [None] * len(rows)
                    for r, row in enumerate(group.rows):
                        out[row] = None if group.stopped_before[r] else int(tokens[r])
                    ended = yield StepOutput(group.steps - 1, out)
                    for row in ended or ():  # the consumer ends these rows here (Generator.stream's send)
                        self._end(group, row, len(rows), reasons)
                    if group.finished.all() or group.steps == max_new_tokens:
                        active.remove(group)
                        self.model.close(group.key)
                        continue
                    group.handle = self.model.forward(group.key, io_spec.DECODE, tokens[:, None],
                                                      group.lengths[:, None].copy(), group.lengths.copy())
                    group.lengths += 1
                    decode_tokens += int((~group.finished).sum())  # the rows still generating
                if prefill_ms is None:  # every group's first token: the prompts' prefill
                    prefill_ms = (time.perf_counter() - t0) * 1e3
        finally:
            for group in groups:  # an error, or a consumer that stopped: free every stage's caches
                self.model.close(group.key)
        total_ms = (time.perf_counter() - t0) * 1e3
        prefill_ms = total_ms if prefill_ms is None else prefill_ms
        return GenerationResult(generated, reasons, prefill_ms, total_ms - prefill_ms, decode_tokens)

    def _start(self, part: np.ndarray, rows: list[list[int]]) -> _MicroBatch:
        """A micro-batch of these rows with its prefill in flight (one chunk: every prompt, right-padded)."""
        prompts = [rows[i] for i in part]
        b, longest = len(prompts), max(len(r) for r in prompts)
        ids = np.zeros((b, longest), np.int64)
        for r, row in enumerate(prompts):
            ids[r, : len(row)] = row
        lengths = np.array([len(r) for r in prompts], np.int64)
        vocab = self.model.config.vocab_size
        group = _MicroBatch(f"{next(_keys)}", [int(i) for i in part], lengths,
                            [np.asarray(r, np.int64) for r in prompts], [None] * b,
                            [row_generator(self.sampling.seed, int(i)) for i in part],
                            [np.zeros(vocab, np.int32) for _ in prompts] if self.sampling.counts_tokens else None,
                            np.zeros(b, bool))
        positions = np.broadcast_to(np.arange(longest, dtype=np.int64), (b, longest)).copy()
        group.handle = self.model.forward(group.key, io_spec.PREFILL, ids, positions, np.zeros(b, np.int64),
                                          lengths - 1)
        return group

    @staticmethod
    def _end(group: _MicroBatch, row: int, rows: int, reasons: list[str]) -> None:
        """Finish `row` ("stop") at the step its micro-batch just yielded."""
        check_ended_row(row, rows)
        if row not in group.rows:
            raise InputError(f"row {row} sent to end is not in the step just yielded (its micro-batch's rows are "
                             f"{group.rows})")
        r = group.rows.index(row)
        if not group.finished[r]:
            group.finished[r], reasons[row] = True, "stop"

    def _sample(self, group: _MicroBatch, logits: np.ndarray, generated: list[list[int]],
                reasons: list[str], allowed: np.ndarray | None) -> np.ndarray:
        group.stopped_before = group.finished.copy()
        tokens = sample(logits, self.sampling, group.rng, group.history, group.counts, allowed)
        for r, row in enumerate(group.rows):
            if group.finished[r]:
                continue
            token = int(tokens[r])
            generated[row].append(token)
            group.history[r], group.history_buffers[r] = appended(group.history[r], group.history_buffers[r], token)
            if group.counts is not None:
                group.counts[r][token] += 1
            if token in self.stop_token_ids:
                group.finished[r], reasons[row] = True, "stop"
        group.steps += 1
        return tokens
