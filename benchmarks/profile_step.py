"""Where one decode step's time goes, by operator type, at several batch sizes: onnxruntime's own profiler.

    .venv/bin/python benchmarks/profile_step.py EXPORT_DIR [--batches 1,16] [--context 128] [--steps 50]
        [--threads 0] [--prepack/--no-prepack] [--prefill TOKENS]

With --prefill TOKENS it profiles a prefill of TOKENS tokens (batch 1, one chunk, a fresh cache each time) instead,
STEPS times.

For each batch size: a decode-only model whose session has onnxruntime's profiler on, its caches filled with
random data (never the zero page) up to CONTEXT slots per row, a few warm-up steps, then STEPS timed steps, first
with the model's own session and then with the profiler on. Prints both wall times per step (the profiler costs
~15 us per node here, ~3.8 ms per step on the demo, the same at every batch, so small ops look larger than they
are), and per operator type the profiled microseconds per step, its share of kernel time and how it grows from the
first batch size to each larger one (for a weight-bound step a larger batch costs little more; an op that grows
with the batch is where the batched step stops scaling).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort


def profile(export: str, batch: int, context: int, steps: int, threads: int,
            prepack: bool, prefill: int = 0) -> tuple[float, float, dict]:
    """(wall ms per step unprofiled, the same profiled, {op type: kernel microseconds per step}) at this batch; with
    `prefill` tokens, per prefill of that many tokens instead."""
    from mla_deploy import io_spec
    from mla_deploy.runtime import ExportedModel, RuntimeOptions

    kind = io_spec.PREFILL if prefill else io_spec.DECODE
    model = ExportedModel(export, RuntimeOptions(threads=threads, prepack=prepack), graphs=(kind,))

    def timed() -> float:
        return _timed_prefills(model, prefill, steps) if prefill else _timed_steps(model, batch, context, steps)

    plain_ms = timed()
    with tempfile.TemporaryDirectory() as tmp:
        so = model.session_options()  # the same session, plus the profiler
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "step")
        graph = Path(export) / model.manifest["graphs"][kind]["file"]
        model.sessions[kind] = session = ort.InferenceSession(str(graph), so, providers=model.providers)
        wall_ms = timed()
        events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    timed = sorted(runs, key=lambda e: e["ts"])[-steps:]  # the last STEPS runs: the timed ones
    start = timed[0]["ts"]
    by_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= start:
            by_op[e["args"]["op_name"]] += e["dur"] / steps
    return plain_ms, wall_ms, dict(by_op)


def _timed_steps(model, batch: int, context: int, steps: int) -> float:
    """Milliseconds per decode step over `steps` steps after 5 warm-up steps, caches holding random data."""
    from mla_deploy.bench.engines import random_decode_state
    from mla_deploy.runtime import Generator, SamplingParams

    gen = Generator(model, SamplingParams(), stop_token_ids=())
    warmup = 5
    rng = np.random.default_rng(0)
    state = random_decode_state(gen, batch, context, warmup + steps + 1, rng)
    tokens = rng.integers(0, model.config.vocab_size, batch)
    for _ in range(warmup):
        gen.decode_step(state, tokens)
    t0 = time.perf_counter()
    for _ in range(steps):
        gen.decode_step(state, tokens)
    return (time.perf_counter() - t0) / steps * 1e3


def _timed_prefills(model, tokens: int, runs: int) -> float:
    """Milliseconds per prefill of `tokens` random tokens in one chunk (a fresh cache each), after 2 warm-up ones."""
    from mla_deploy.runtime import Generator, SamplingParams

    gen = Generator(model, SamplingParams(), chunk_size=tokens, stop_token_ids=())
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, tokens).tolist()
    states = [gen.new_state([np.asarray(prompt)]) for _ in range(2 + runs)]
    for state in states[:2]:
        gen.prefill(state, [prompt])
    t0 = time.perf_counter()
    for state in states[2:]:
        gen.prefill(state, [prompt])
    return (time.perf_counter() - t0) / runs * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--prepack", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens instead")
    args = parser.parse_args()
    batches = [1] if args.prefill else [int(b) for b in args.batches.split(",")]
    results = {b: profile(args.export, b, args.context, args.steps, args.threads, args.prepack, args.prefill)
               for b in batches}
    what = f"prefill of {args.prefill} tokens" if args.prefill else f"decode step at context {args.context}"
    print(f"{args.export}: {what}, {args.steps} runs, threads {args.threads or 'default'}, "
          f"prepack {'on' if args.prepack else 'off'}")
    for b, (plain, wall, ops) in results.items():
        kernels = sum(ops.values()) / 1e3
        tokens = args.prefill or b
        print(
            f"batch {b}: {plain:.3f} ms per {'prefill' if args.prefill else 'step'} unprofiled "
            f"({tokens / plain * 1e3:.0f} tokens/s); profiled {wall:.3f} ms, kernels {kernels:.3f} ms "
            f"({kernels / wall:.0%}; the profiler's own cost lands on every node, and an If's time includes its "
            f"branch's nodes)"
        )
    first = batches[0]
    ops = sorted(set().union(*(r[2] for r in results.values())), key=lambda o: -results[batches[-1]][2].get(o, 0))
    print("| op | " + " | ".join(f"batch {b} us (share)" for b in batches) + " | "
          + " | ".join(f"x{b} / x{first}" for b in batches[1:]) + " |")
    print("|---|" + "---|" * (2 * len(batches) - 1))
    for op in ops:
        cells = []
        for b in batches:
            us, total = results[b][2].get(op, 0.0), sum(results[b][2].values())
            cells.append(f"{us:.0f} ({us / total:.0%})")
        growth = [f"{results[b][2].get(op, 0.0) / results[first][2][op]:.2f}" if results[first][2].get(op) else "-"
                  for b in batches[1:]]
        print(f"| {op} | " + " | ".join(cells) + " | " + " | ".join(growth) + " |")


if __name__ == "__main__":
    main()
