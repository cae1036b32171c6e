"""Aggregate decode tokens/s of many concurrent streams: a whole export in one process against the same checkpoint's
staged export (export --stages N) as Ray actors on a local Ray instance, alternating, in one run.

    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/stages_throughput.py WHOLE_DIR STAGED_DIR \\
        [--streams 16] [--prompt 64] [--new 64] [--rounds 3] [--micro-batches 1,2]

The whole export runs on every core (onnxruntime's default threads); each stage's actor on its share of them
(runtime.stages). Decode tokens/s counts the tokens decoded after every stream's first (prefill) token, over the time
they took; the ratio is staged / whole, per round and as the median. Every stage's resident memory is printed.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("whole")
    parser.add_argument("staged")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream")
    parser.add_argument("--new", type=int, default=64, help="new tokens per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stage-threads", type=int, default=0, help="onnxruntime threads per stage (0: its share)")
    parser.add_argument("--micro-batches", default="1,2", help="comma-separated: groups of streams in flight at once")
    args = parser.parse_args()

    import ray

    from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
    from mla_deploy.runtime.pipeline import PipelineGenerator
    from mla_deploy.runtime.stages import StagedModel

    whole = ExportedModel(args.whole)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, whole.config.vocab_size, args.prompt).tolist() for _ in range(args.streams)]
    greedy = SamplingParams()
    ray.init(include_dashboard=False, log_to_driver=False)
    staged = StagedModel(args.staged, RuntimeOptions(threads=args.stage_threads))
    for p in staged.placement:
        print(f"stage {p['index']}: layers {p['layers'][0]}-{p['layers'][1]}, "
              f"weights {p['weights_bytes'] / 1e9:.3f} GB, actor RSS {p['rss_bytes'] / 1e9:.2f} GB")
    runs = {"whole": lambda: Generator(whole, greedy, stop_token_ids=()).generate(prompts, args.new)}
    for m in (int(x) for x in args.micro_batches.split(",")):
        runs[f"{len(staged.actors)} stages, {m} micro-batch{'es' if m > 1 else ''}"] = (
            lambda m=m: PipelineGenerator(staged, greedy, stop_token_ids=(), micro_batches=m).generate(prompts,
                                                                                                      args.new))
    tokens = {name: run().token_ids for name, run in runs.items()}  # warm-up, and the tokens compared
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        for name, run in runs.items():
            rates[name].append(run().decode_tokens_per_s)
            print(f"round {round_ + 1}, {name}: {rates[name][-1]:.1f} decode tok/s", flush=True)
    print(f"{args.streams} streams, {args.prompt} prompt tokens, {args.new} new tokens each, {args.rounds} rounds")
    print("| engine | decode tok/s per round | median | / whole | tokens as whole |")
    print("|---|---|---|---|---|")
    base = statistics.median(rates["whole"])
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {median:.1f} | {median / base:.2f} | "
              f"{tokens[name] == tokens['whole']} |")
    staged.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
