"""What sampling one token costs per row, at the demo's vocabulary and at DeepSeek's, beside the whole-vocabulary
stable sort that top-p used before `sampling.nucleus_ids` (alternating, in one run).

    .venv/bin/python benchmarks/sampling_speed.py [--rounds 5]

Logits are synthetic but shaped like a trained model's (a normal spread plus a few dozen far likelier tokens, so
the nucleus at temperature 0.7 and top_p 0.9 holds tens of tokens), one row per call as the server's scheduler
samples them, with a 500-token history for the repetition penalty.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mla_deploy.runtime import sampling
from mla_deploy.runtime.sampling import SamplingParams, sample

CASES = {
    "greedy": SamplingParams(),
    "greedy, repetition 1.1": SamplingParams(repetition_penalty=1.1),
    "T 0.7, top_p 0.9, repetition 1.1 (the demo's defaults)": SamplingParams(temperature=0.7, top_p=0.9,
                                                                             repetition_penalty=1.1),
}


def whole_vocabulary_nucleus_ids(p: np.ndarray, top_p: float) -> np.ndarray:
    """The method before nucleus_ids(): the row's whole vocabulary sorted."""
    order = np.argsort(-p, kind="stable")
    sorted_p = p[order]
    return np.sort(order[np.cumsum(sorted_p) - sorted_p < top_p])


def per_row_ms(logits: np.ndarray, params: SamplingParams, history: list[np.ndarray]) -> float:
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for i in range(len(logits)):
        sample(logits[i : i + 1], params, rng, history[i : i + 1])
    return (time.perf_counter() - t0) / len(logits) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| vocabulary | sampling | ms per row, whole-vocabulary sort | ms per row, nucleus_ids() | speed-up |")
    print("|---|---|---|---|---|")
    for vocab in (4096, 102400):
        logits = (rng.standard_normal((16, vocab)) * 1.5).astype(np.float32)
        for row in logits:
            row[rng.integers(0, vocab, 30)] += 9.0
        history = [rng.integers(0, vocab, 500) for _ in logits]
        for name, params in CASES.items():
            times = {"sort": [], "nucleus": []}
            for r in range(args.rounds):
                for method in (("sort", "nucleus") if r % 2 else ("nucleus", "sort")):
                    sampling.nucleus_ids = whole_vocabulary_nucleus_ids if method == "sort" else NUCLEUS
                    times[method].append(per_row_ms(logits, params, history))
            sampling.nucleus_ids = NUCLEUS
            old, new = statistics.median(times["sort"]), statistics.median(times["nucleus"])
            print(f"| {vocab} | {name} | {old:.3f} | {new:.3f} | {old / new:.1f}x |")


NUCLEUS = sampling.nucleus_ids

if __name__ == "__main__":
    main()
