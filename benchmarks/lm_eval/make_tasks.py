"""Writes the local lm-evaluation-harness tasks over the demo model's held-out code
(mla_deploy/models/demo/heldout.txt):

- demo_next_line (multiple choice): six lines of held-out Python, then which of four lines comes next (the true
  one and three others of similar length from the same files); accuracy by loglikelihood, as lm-eval's
  multiple-choice tasks score.
- demo_complete_line (generation): the same context, the model writes the next line (until a newline);
  exact match against the true line.

Data files are JSON lines beside their task YAMLs; the YAMLs name them relative to the repository root (run
lm-eval from there). Deterministic: the same files on every run.

    python benchmarks/lm_eval/make_tasks.py     # benchmarks/lm_eval/*.jsonl and the test's tests/lm_eval/*.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTEXT_LINES = 6


def items(text: str, count: int, seed: int) -> list[dict]:
    lines = text.split("\n")
    candidates = [i for i in range(CONTEXT_LINES, len(lines))
                  if 12 <= len(lines[i].strip()) <= 70 and all(lines[i - k].strip() for k in (1, 2))]
    rng = random.Random(seed)
    picked = sorted(rng.sample(candidates, count))
    out = []
    for i in picked:
        gold = lines[i] + "\n"
        others = [j for j in candidates if abs(len(lines[j]) - len(lines[i])) <= 12 and lines[j] != lines[i]]
        distractors = [lines[j] + "\n" for j in rng.sample(others, 3)]
        label = rng.randrange(4)
        choices = distractors[:label] + [gold] + distractors[label:]
        out.append({"context": "\n".join(lines[i - CONTEXT_LINES:i]) + "\n", "choices": choices, "label": label,
                    "target": lines[i]})
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main() -> None:
    text = (ROOT / "mla_deploy/models/demo/heldout.txt").read_text()
    write(ROOT / "benchmarks/lm_eval/next_line.jsonl", items(text, 200, seed=0))
    write(ROOT / "benchmarks/lm_eval/complete_line.jsonl", items(text, 40, seed=1))
    write(ROOT / "tests/lm_eval/next_line.jsonl", items(text, 8, seed=2))


if __name__ == "__main__":
    main()
