"""Choose the bundled demo model's generation defaults (mla_deploy/models/demo/generation_config.json) from
measured samples.

Steps: export the demo (`mla-deploy export -o out/demo`), then
    .venv/bin/python benchmarks/demo_sampling.py out/demo [--tokens 96] [--seeds 4]

For each candidate setting it samples every prompt below with several seeds and prints, per setting:
- repeated lines: the share of generated non-blank lines that repeat an earlier line of the same sample
  (greedy decoding of "def " loops on "#" lines: this is the failure to avoid);
- distinct 4-grams: distinct token 4-grams / all 4-grams in the generated ids (higher = less looping);
- nll: the model's own mean negative log-likelihood of the sampled tokens under its unfiltered
  distribution (lower = more typical text; high temperature drives it up).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_deploy.runtime import ExportedModel, Generator, SamplingParams  # noqa: E402
from mla_deploy.runtime.text import Tokenizer  # noqa: E402

PROMPTS = ["def ", "import os\n", "class Parser:\n    def __init__(self", "for i in range(", "# Read the file\n",
           "    if not ", "try:\n    ", "return "]
SETTINGS = {
    "greedy": SamplingParams(),
    "greedy, rep 1.2": SamplingParams(repetition_penalty=1.2),
    "t 0.6 top_p 0.9": SamplingParams(temperature=0.6, top_p=0.9),
    "t 0.7 top_p 0.9 rep 1.1": SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1),
    "t 0.8 top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "t 0.8 top_k 40 rep 1.1": SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1),
    "t 1.0": SamplingParams(temperature=1.0),
}


def measure(model, tok, params: SamplingParams, tokens: int, seeds: int) -> tuple[float, float, float]:
    repeated = lines = grams = distinct = 0
    nll = []
    for seed in range(seeds):
        for prompt in PROMPTS:
            p = SamplingParams(params.temperature, params.top_k, params.top_p, params.repetition_penalty, seed)
            gen = Generator(model, p, stop_token_ids=[])
            ids = tok.encode(prompt)
            out = gen.generate([ids], tokens).token_ids[0]
            nll.append(_nll(model, ids, out))
            text_lines = [line.strip() for line in tok.decode(out).splitlines() if line.strip()]
            repeated += sum(line in text_lines[:i] for i, line in enumerate(text_lines))
            lines += len(text_lines)
            four = [tuple(out[i:i + 4]) for i in range(len(out) - 3)]
            grams += len(four)
            distinct += len(set(four))
    return repeated / max(lines, 1), distinct / max(grams, 1), float(np.mean(nll))


def _nll(model, prompt: list[int], generated: list[int]) -> float:
    """Mean -log p(token) of the generated tokens, scored by one prefill of prompt + generated."""
    from mla_deploy.runtime.feeds import prefill_feed

    ids = np.asarray([prompt + generated], np.int64)
    logits = model.run("prefill", prefill_feed(model.config, ids))["logits"][0].astype(np.float64)  # [T, vocab]
    logits = logits[len(prompt) - 1 : -1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(generated)), generated].mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("export_dir")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    model = ExportedModel(args.export_dir)
    tok = Tokenizer(Path(args.export_dir) / "tokenizer.json")
    print(f"{len(PROMPTS)} prompts x {args.seeds} seeds x {args.tokens} tokens")
    print("| setting | repeated lines | distinct 4-grams | nll (nats/token) |")
    print("|---|---|---|---|")
    for name, params in SETTINGS.items():
        rep, dist, nll = measure(model, tok, params, args.tokens, args.seeds)
        print(f"| {name} | {rep:.1%} | {dist:.1%} | {nll:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
