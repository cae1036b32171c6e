"""A pass of T tokens over a cache of `context` tokens, as speculative decoding's verification and a chunk of
chunked prefill make one: through the verify graph (the decode graph's absorbed attention over a token axis, always)
and through the prefill graph (the form its rule picks for T tokens over those slots: naive or absorbed), beside one
decode step, at several contexts, interleaved. Both return the logits of every position. Given several exports (of
the same checkpoint: two builds of the graphs, two sets of options), each form of each, interleaved the same way.

    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/verify_form.py EXPORT [EXPORT ...] [--contexts 100,400,900]
        [--tokens 1,2,3,5,9] [--threads 2] [--repeats 15] [--json benchmarks/results/verify_form.json]

Both forms' sessions prepack their weights (a few-row MatMul over an unpacked weight repacks it on every call), so
the comparison is of the attention forms. The fastest of `repeats` runs per point (this machine is shared: the
fastest is the least disturbed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from compare_llamacpp import cpu_model

    from mla_deploy.runtime import ExportedModel, RuntimeOptions
    from mla_deploy.runtime.cache import CacheBuffers, DecodeBinding
    from mla_deploy.runtime.speculative import verification_pass

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("exports", type=Path, nargs="+")
    ap.add_argument("--contexts", default="100,400,900")
    ap.add_argument("--tokens", default="1,2,3,5,9")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    models = {path.name if len(args.exports) > 1 else "": ExportedModel(
        path, RuntimeOptions(threads=args.threads, prepack=True), graphs=("prefill", "decode", "verify"))
        for path in args.exports}
    if len(models) != len(args.exports):
        ap.error("the exports' directory names must differ: they name the figures")
    cfg = next(iter(models.values())).config
    rng = np.random.default_rng(0)
    results = {"date": date.today().isoformat(), "cpu": cpu_model(), "threads": args.threads,
               "exports": [path.name for path in args.exports], "command": " ".join(sys.argv), "points": []}
    tokens = [int(x) for x in args.tokens.split(",")]
    for ctx in (int(c) for c in args.contexts.split(",")):
        runs = {}
        for label, model in models.items():
            caches = CacheBuffers(cfg, 1, ctx + max(tokens), model.max_seq_len, "cpu", model.cache_format)
            for array in caches.arrays.values():  # real values: never-written zero pages read faster than memory
                array[:] = rng.standard_normal(array.shape).astype(array.dtype)
            d = DecodeBinding(model.sessions["decode"], caches, 1, cfg.vocab_size)
            d.pos[:], d.write[:], d.ids[:] = ctx, ctx, 5
            lengths = np.array([ctx], np.int64)
            name = f"{label} " if label else ""
            runs[f"{name}decode"] = partial(model.sessions["decode"].run_with_iobinding, d.binding)
            for t in tokens:
                ids = rng.integers(3, cfg.vocab_size, (1, t))
                for form in ("verify", "prefill"):
                    runs[f"{name}{form} T={t}"] = partial(verification_pass, model, caches, ids, lengths, form)
        best = {name: float("inf") for name in runs}
        for _ in range(args.repeats):  # interleaved: each repeat visits every form once
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - t0)
        point = {"context": ctx, "ms": {name: round(s * 1e3, 3) for name, s in best.items()}}
        results["points"].append(point)
        print(f"ctx {ctx}: " + ", ".join(f"{n} {v:.2f}" for n, v in point["ms"].items()) + " ms", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
