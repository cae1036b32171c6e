"""Load time and memory of several exports with the runtime's default options, side by side.

    .venv/bin/python benchmarks/load_memory.py EXPORT_DIR [EXPORT_DIR ...] [--threads 2] [--repeats 3]

Each export is loaded in a child process of its own (both graphs, `ExportedModel` with default RuntimeOptions: a
quantized export in mla-deploy's kernels runs mapped, one in onnxruntime's MatMulNBits / QMoE prepacked), the
exports taking turns repeat by repeat, so machine noise lands on all of them. Per export: the load time (median of
the repeats; the first repeat may read weights.bin from disk, the later ones from page cache), anonymous memory
and PSS after loading (what loading copied; /proc/self/smaps_rollup) and after a 512-token prefill and 8 decode
steps, each against the size of weights.bin.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, sys
import numpy as np
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from mla_deploy.runtime.memory import resident_memory
before = resident_memory()
model = ExportedModel(sys.argv[1], RuntimeOptions(threads=int(sys.argv[2])))
out = {"load_s": model.load_seconds, "before": before.to_dict(), "loaded": model.load_memory.to_dict(),
       "prepack": model.prepack}
gen = Generator(model, SamplingParams(), stop_token_ids=())
prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 512).tolist()
gen.generate([prompt], 8)
out["ran"] = resident_memory().to_dict()
print(json.dumps(out))
"""


def measure(directory: Path, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(directory), str(threads)], capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dirs", nargs="+", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {str(d): [] for d in args.export_dirs}
    for _ in range(args.repeats):
        for d in args.export_dirs:
            runs[str(d)].append(measure(d, args.threads))
    MB = 1e6
    print("| export | weights.bin MB | prepacked | load s (median; each) | anonymous after load MB (/ weights) | "
          "PSS after load MB | anonymous after prefill 512 + 8 steps MB (/ weights) |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for d in args.export_dirs:
        weights = (d / "weights.bin").stat().st_size
        rs = runs[str(d)]
        load = [r["load_s"] for r in rs]
        anon = statistics.median(r["loaded"]["anonymous"] - r["before"]["anonymous"] for r in rs)
        pss = statistics.median(r["loaded"]["pss"] for r in rs)
        ran = statistics.median(r["ran"]["anonymous"] - r["before"]["anonymous"] for r in rs)
        rows[d.name] = {"weights_bytes": weights, "load_s": load, "anonymous_loaded": anon, "pss_loaded": pss,
                        "anonymous_ran": ran, "prepack": rs[0]["prepack"]}
        print(f"| {d.name} | {weights / MB:.0f} | {rs[0]['prepack']} | {statistics.median(load):.2f} "
              f"({', '.join(f'{x:.2f}' for x in load)}) | {anon / MB:.0f} ({anon / weights:.3f}) | {pss / MB:.0f} | "
              f"{ran / MB:.0f} ({ran / weights:.3f}) |")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "exports": rows}, indent=1))


if __name__ == "__main__":
    main()
