"""Two exports of the same checkpoint, decode and prefill speed side by side in one process.

    .venv/bin/python benchmarks/compare_exports.py BASELINE_DIR CANDIDATE_DIR [--prepack] [--threads N] \
        [--contexts 128,4096]

Both are driven by this version's runtime with the same options, alternately point by point
(benchmarks/side_by_side.py), and the ratio candidate / baseline printed per point: for example two builds of the
graph code, or two sets of export options.
"""

from __future__ import annotations

import argparse

import side_by_side


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline")
    parser.add_argument("candidate")
    parser.add_argument(
        "--prepack", action="store_true", help="onnxruntime prepacking on (copies the weights per session)"
    )
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--contexts", default="128,4096", help="decode points: comma-separated contexts")
    args = parser.parse_args()
    from mla_deploy.runtime import ExportedModel, RuntimeOptions

    options = RuntimeOptions(prepack=args.prepack, threads=args.threads)
    models = {"baseline": ExportedModel(args.baseline, options), "candidate": ExportedModel(args.candidate, options)}
    print(f"prepack {'on' if args.prepack else 'off'}; baseline {args.baseline}, candidate {args.candidate}")
    print("| point | baseline ms | candidate ms | candidate / baseline |")
    print("|---|---|---|---|")
    contexts = tuple(int(c) for c in args.contexts.split(","))
    for point, by in side_by_side.speed(models, contexts=contexts).items():
        print(f"| {point} | {by['baseline']:.1f} | {by['candidate']:.1f} | {by['candidate'] / by['baseline']:.3f} |")


if __name__ == "__main__":
    main()
