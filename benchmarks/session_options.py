"""onnxruntime session settings that might speed up one export, each against the default, alternating processes.

    .venv/bin/python benchmarks/session_options.py EXPORT_DIR [--threads 2] [--contexts 128,4096,16384] [--repeats 3]

The levers issue #11 asked to measure rather than assume:

  default          RuntimeOptions' defaults (threads spinning between ops, the export's prepacking choice);
  block_base_4     `session.dynamic_block_base` 4: onnxruntime splits a parallel loop into shrinking blocks
                   (its own docs suggest 4) instead of one static share per thread;
  denormals_zero   `session.set_denormal_as_zero` 1: flush-to-zero / denormals-are-zero on onnxruntime's threads;
  pinned           `session.intra_op_thread_affinities`: the pool's worker threads pinned to one logical
                   processor each, the second onward (the caller, onnxruntime's first intra-op thread, is free);
  no_spin          threads not spinning between ops (what `serve` uses), for scale.

Each setting runs in its own process, as a deployment would (several sessions in one process measure each other:
an idle session's spinning worker takes a core from the next one, and a pinned worker escapes that, so pinning
looked 25 % faster in one process and is not, alone). The processes alternate, each label leading in turn, REPEATS
times; each measures prefill of 512 tokens and one decode step at each context, batch 1 (benchmarks/side_by_side.py:
warm-up, then medians). Prints the median over repeats per point, its spread, and the ratio to the default
(< 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import side_by_side
from mla_deploy.runtime import ExportedModel, RuntimeOptions
kw = json.loads(sys.argv[4])
kw["session_config"] = tuple(tuple(e) for e in kw.get("session_config", ()))
model = ExportedModel(sys.argv[2], RuntimeOptions(threads=int(sys.argv[3]), **kw))
contexts = tuple(int(c) for c in sys.argv[5].split(","))
print(json.dumps({p: by["x"] for p, by in side_by_side.speed({"x": model}, contexts=contexts).items()}))
"""


def levers(threads: int) -> dict[str, dict]:
    """{label: RuntimeOptions keyword arguments}, the default first."""
    workers = max((threads or os.cpu_count() or 1) - 1, 0)  # onnxruntime's pool: the caller plus N - 1 workers
    pinned = ";".join(str(cpu) for cpu in range(2, 2 + workers))  # onnxruntime numbers logical processors from 1
    out = {
        "default": {},
        "block_base_4": {"session_config": [["session.dynamic_block_base", "4"]]},
        "denormals_zero": {"session_config": [["session.set_denormal_as_zero", "1"]]},
        "no_spin": {"spin": False},
    }
    if workers and 1 + workers <= (os.cpu_count() or 1):
        out["pinned"] = {"session_config": [["session.intra_op_thread_affinities", pinned]]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="128,4096,16384", help="decode points: comma-separated contexts")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    options = levers(args.threads)
    labels = list(options)
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    here = str(Path(__file__).resolve().parent)
    for r in range(args.repeats):
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    here,
                    args.export,
                    str(args.threads),
                    json.dumps(options[label]),
                    args.contexts,
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[label].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"repeat {r + 1}, {label}: " + ", ".join(f"{p} {ms:.2f} ms" for p, ms in runs[label][-1].items()),
                  file=sys.stderr, flush=True)
    print(f"{args.export}, {args.threads} threads, {os.cpu_count()} logical processors, {args.repeats} repeats; "
          + "; ".join(f"{label}: {kw or 'defaults'}" for label, kw in options.items()))
    print("| point | " + " | ".join(f"{label} ms (min-max)" + ("" if label == "default" else ", ratio")
                                    for label in labels) + " |")
    print("|---|" + "---|" * len(labels))
    for point in runs["default"][0]:
        base = statistics.median(run[point] for run in runs["default"])
        cells = []
        for label in labels:
            values = [run[point] for run in runs[label]]
            median = statistics.median(values)
            cell = f"{median:.2f} ({min(values):.2f}-{max(values):.2f})"
            cells.append(cell if label == "default" else f"{cell}, {median / base:.3f}")
        print(f"| {point} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
