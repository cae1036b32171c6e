"""Every precision of one checkpoint side by side: file size, quality against the float source, speed.

    .venv/bin/python benchmarks/precision.py [CHECKPOINT] [--text FILE] [--work DIR] [--threads 2]

Default: the bundled demo model and its held-out text. For float32, float16, bfloat16, int8 and int4 (block 32,
accuracy level 4, factored) it exports (verified against the torch source), runs `eval` (loss and perplexity
against the float32 torch source, top-1 agreement over every scored position), and times prefill of 512 tokens
and decode at context 128 and 960 (benchmarks' OnnxEngine: prepacked, warmed up until steady, medians). Speed
points are taken in rounds, every precision once per round, so a slow spell of the machine hits all of them.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_deploy.bench.engines import OnnxEngine  # noqa: E402
from mla_deploy.evaluate import evaluate  # noqa: E402
from mla_deploy.export import ExportOptions, export  # noqa: E402
from mla_deploy.presets import DEMO_CHECKPOINT  # noqa: E402
from mla_deploy.verify import verify_export  # noqa: E402

PRECISIONS = {
    "float32": ExportOptions(absorb="factored"),
    "float16": ExportOptions(absorb="factored", dtype="float16"),
    "bfloat16": ExportOptions(absorb="factored", dtype="bfloat16"),
    "int8": ExportOptions(absorb="factored", quantize="int8"),
    "int4": ExportOptions(absorb="factored", quantize="int4"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", type=Path, default=DEMO_CHECKPOINT)
    ap.add_argument("--text", type=Path, default=DEMO_CHECKPOINT / "heldout.txt")
    ap.add_argument("--work", type=Path, default=Path("benchmarks/work/precision"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()

    rows = {}
    for name, options in PRECISIONS.items():
        out = args.work / name
        shutil.rmtree(out, ignore_errors=True)
        export(args.checkpoint, out, options)
        check = verify_export(out, args.checkpoint, steps=8)
        report = evaluate(out, args.text, window=args.window, checkpoint_dir=args.checkpoint)
        rows[name] = {"weights_bytes": (out / "weights.bin").stat().st_size, "verify": check.lines[-1],
                      "loss_delta": report.export_loss - report.torch_loss, "top1": report.top1_agreement,
                      "positions": report.tokens, "prefill_tok_s": [], "decode_ms_128": [], "decode_ms_960": []}
        print(f"{name}: {check.lines[-1]}; loss {rows[name]['loss_delta']:+.5f}, top-1 {report.top1_agreement:.2%} "
              f"of {report.tokens}", flush=True)
    for r in range(args.rounds):
        for name in PRECISIONS:
            engine = OnnxEngine(name, args.work / name, args.threads)
            engine.load()
            row = rows[name]
            row["prefill_tok_s"].append(engine.prefill_tokens_per_s(512))
            row["decode_ms_128"].append(engine.decode_step_ms(128, 1, 32))
            row["decode_ms_960"].append(engine.decode_step_ms(960, 1, 32))
            engine.close()
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    base = rows["float32"]
    print("\n| precision | weights.bin | loss vs float32 source | perplexity | top-1 agreement | prefill 512 tok/s "
          "| decode ms ctx 128 | ctx 960 | decode speed vs float32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        med = {k: sorted(row[k])[len(row[k]) // 2] for k in ("prefill_tok_s", "decode_ms_128", "decode_ms_960")}
        row["median"] = med
        speed = sorted(base["decode_ms_128"])[len(base["decode_ms_128"]) // 2] / med["decode_ms_128"]
        print(
            f"| {name} | {row['weights_bytes'] / 1e6:.2f} MB | {row['loss_delta']:+.5f} nats | "
            f"x{math.exp(row['loss_delta']):.4f} | {row['top1']:.2%} of {row['positions']} | "
            f"{med['prefill_tok_s']:.0f} | "
            f"{med['decode_ms_128']:.3f} | {med['decode_ms_960']:.3f} | {speed:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
