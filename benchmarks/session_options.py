"""onnxruntime session settings that might speed up one export, each against the default in one process.

    .venv/bin/python benchmarks/session_options.py EXPORT_DIR [--threads 2] [--contexts 128,4096,16384] [--rounds 5]

The levers issue #11 asked to measure rather than assume, each loaded as its own pair of sessions on the same
export and measured alternately point by point with the default (benchmarks/side_by_side.py: prefill of 512 tokens,
one decode step at each context, batch 1, medians), so machine noise lands on all of them:

  default          RuntimeOptions' defaults (threads spinning between ops, the export's prepacking choice);
  block_base_4     `session.dynamic_block_base` 4: onnxruntime splits a parallel loop into shrinking blocks
                   (its own docs suggest 4) instead of one static share per thread;
  denormals_zero   `session.set_denormal_as_zero` 1: flush-to-zero / denormals-are-zero on onnxruntime's threads;
  pinned           `session.intra_op_thread_affinities`: the pool's worker threads pinned to one logical
                   processor each, the second onward (the caller, onnxruntime's first intra-op thread, is free);
  no_spin          threads not spinning between ops (what `serve` uses), for scale.

Prints one table of milliseconds and the ratio of each lever to the default (< 1 is faster).
"""

from __future__ import annotations

import argparse
import os

import side_by_side


def levers(threads: int) -> dict[str, dict]:
    """{label: RuntimeOptions keyword arguments} beside the default."""
    workers = max((threads or os.cpu_count() or 1) - 1, 0)  # onnxruntime's pool: the caller plus N - 1 workers
    pinned = ";".join(str(cpu) for cpu in range(2, 2 + workers))  # onnxruntime numbers logical processors from 1
    out = {
        "default": {},
        "block_base_4": {"session_config": (("session.dynamic_block_base", "4"),)},
        "denormals_zero": {"session_config": (("session.set_denormal_as_zero", "1"),)},
        "no_spin": {"spin": False},
    }
    if workers and 1 + workers <= (os.cpu_count() or 1):
        out["pinned"] = {"session_config": (("session.intra_op_thread_affinities", pinned),)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="128,4096,16384", help="decode points: comma-separated contexts")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    from mla_deploy.runtime import ExportedModel, RuntimeOptions

    options = levers(args.threads)
    models = {label: ExportedModel(args.export, RuntimeOptions(threads=args.threads, **kw)) for label, kw in options.items()}
    contexts = tuple(int(c) for c in args.contexts.split(","))
    print(f"{args.export}, {args.threads} threads, {os.cpu_count()} logical processors; " +
          "; ".join(f"{label}: {kw or 'defaults'}" for label, kw in options.items()))
    others = [label for label in models if label != "default"]
    print("| point | default ms | " + " | ".join(f"{label} ms (ratio)" for label in others) + " |")
    print("|---|---|" + "---|" * len(others))
    for point, by in side_by_side.speed(models, rounds=args.rounds, contexts=contexts).items():
        cells = " | ".join(f"{by[label]:.2f} ({by[label] / by['default']:.3f})" for label in others)
        print(f"| {point} | {by['default']:.2f} | {cells} |")


if __name__ == "__main__":
    main()
