"""Speed of several loaded exports measured alternately, point by point, in one process (machine noise lands on
all of them): prefill of 512 tokens and one decode step at each context (128 and 4096 by default), batch 1. Used by
runtime_memory.py (one export, two runtime options) and compare_exports.py (two exports, one option).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

CONTEXTS = (128, 4096)


def steps_room(rounds: int = 5, warmup: int = 3) -> int:
    """Positions a decode point takes past its context: every timed and warm-up step."""
    return 4 * (rounds + warmup) + 2


def speed(
    models: dict, rounds: int = 5, warmup: int = 3, contexts: tuple[int, ...] = CONTEXTS
) -> dict[str, dict[str, float]]:
    """{label: ExportedModel} -> {point: {label: median ms}}."""
    points = ("prefill 512", *(f"decode ctx {ctx}" for ctx in contexts))
    from mla_deploy.bench.engines import random_decode_state
    from mla_deploy.runtime import Generator, SamplingParams

    gens = {label: Generator(model, SamplingParams(), stop_token_ids=()) for label, model in models.items()}
    rng = np.random.default_rng(0)
    vocab = next(iter(models.values())).config.vocab_size
    prompt = rng.integers(0, vocab, 512).tolist()
    states = {}
    for label, gen in gens.items():
        for ctx in contexts:
            states[label, ctx] = random_decode_state(gen, 1, ctx, steps_room(rounds, warmup), rng)
    runs = {}
    for label, gen in gens.items():
        runs[label, points[0]] = lambda gen=gen: gen.prefill(gen.new_state([np.asarray(prompt)]), [prompt])
        for ctx, point in zip(contexts, points[1:]):
            runs[label, point] = lambda gen=gen, s=states[label, ctx]: gen.decode_step(s, np.array([7]))
    for _ in range(warmup):  # the first calls after loading are slow (page faults, thread pools)
        for fn in runs.values():
            fn()
    times: dict[tuple, list[float]] = {key: [] for key in runs}
    labels = list(gens)
    for r in range(rounds):
        order = labels[r % len(labels):] + labels[: r % len(labels)]  # each label leads in turn: no fixed neighbour
        for point in points:
            for label in order:
                for _ in range(1 if point == points[0] else 4):
                    t0 = time.perf_counter()
                    runs[label, point]()
                    times[label, point].append(time.perf_counter() - t0)
    return {point: {label: statistics.median(times[label, point]) * 1e3 for label in gens} for point in points}
