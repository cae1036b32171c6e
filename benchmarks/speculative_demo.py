"""Speculative decoding on the bundled demo model: decode tokens/s and draft acceptance per mode, on a prompt that
restates code it was given (prompt lookup's case) and on held-out standard-library text (the MTP draft's), greedy,
the modes interleaved in each repeat (mla_deploy.bench.speculative); then prompt lookup's match length and draft
length over the same prompts.

    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/speculative_demo.py [--export out/demo] [--threads 2]
        [--pieces 4] [--new-tokens 128] [--repeats 3] [--draft-tokens K]
        [--json benchmarks/results/speculative_demo.json]

Held-out prompts: --pieces windows of mla_deploy/models/demo/heldout.txt (files the model never trained on), 600
characters each from evenly spaced places.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_llamacpp import cpu_model, log  # noqa: E402

GRID = [(ngram, low, k) for ngram in (2, 3, 4) for low in (1, 2) if low <= ngram for k in (2, 4, 8)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, default=ROOT / "benchmarks" / "work" / "demo-speculative")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pieces", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-tokens", type=int, default=None, help="the most drafted a step (default: the runtime's)")
    ap.add_argument("--grid", action="store_true", help="also time lookup's (ngram, min_ngram, draft tokens) grid")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from mla_deploy.bench.speculative import prompts, speculative_rows, table
    from mla_deploy.presets import DEMO_CHECKPOINT
    from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
    from mla_deploy.runtime.speculative import Speculation

    if not (args.export / "manifest.json").exists():
        from mla_deploy.export import ExportOptions, export

        log(f"exporting the demo to {args.export}")
        export(DEMO_CHECKPOINT, args.export, ExportOptions(force=True))
    text = (DEMO_CHECKPOINT / "heldout.txt").read_text()
    step = (len(text) - 600) // args.pieces
    texts = {f"held-out {i + 1}": text[i * step : i * step + 600] for i in range(args.pieces)}
    draft_tokens = args.draft_tokens or Speculation().draft_tokens
    rows = speculative_rows(args.export, ("off", "auto", "lookup", "mtp"), args.threads, args.new_tokens, draft_tokens,
                            args.repeats, texts, progress=log)
    results = {"date": date.today().isoformat(), "cpu": cpu_model(), "threads": args.threads,
               "draft_tokens": draft_tokens,
               "command": " ".join(sys.argv), "rows": rows}
    print("\n".join(table(rows)))
    held = [r for r in rows if r["prompt"].startswith("held-out")]
    for mode in ("lookup", "mtp"):
        mine = [r for r in held if r["mode"] == mode]
        if mine:
            results[f"held_out_{mode}"] = {
                "vs_off_median": statistics.median(r["vs_off"] for r in mine),
                "first_token_acceptance": [r.get("first_token_acceptance") for r in mine],
                "acceptance": [r.get("acceptance") for r in mine]}
    if args.grid:  # lookup's settings, each against off over the same prompts and in the same run
        model = ExportedModel(args.export, RuntimeOptions(threads=args.threads, prepack=True))
        chosen = prompts(model, texts)
        off = Generator(model, SamplingParams(), stop_token_ids=())
        results["grid"] = []
        for ngram, low, k in GRID:
            spec = Generator(
                model, SamplingParams(), stop_token_ids=(), speculation=Speculation("lookup", k, ngram, low)
            )
            for name, ids in chosen.items():
                speeds, base = [], []
                for _ in range(args.repeats):
                    base.append(off.generate([ids], args.new_tokens).decode_tokens_per_s)
                    run = spec.generate([ids], args.new_tokens)
                    speeds.append(run.decode_tokens_per_s)
                point = {"ngram": ngram, "min_ngram": low, "draft_tokens": k, "prompt": name,
                         "vs_off": statistics.median(speeds) / statistics.median(base), **run.speculation.to_dict()}
                results["grid"].append(point)
                log(f"lookup ngram {ngram}..{low}, k {k}, {name}: {point['vs_off']:.2f}x, "
                    f"acceptance {point['acceptance']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
