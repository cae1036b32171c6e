"""Speculative decoding against llama.cpp's plain decode: v2lite-2L (DeepSeek-V2-Lite's shapes, 2 layers, random
weights) as our int4 export, beside llama.cpp's q4_0 at batch 1, interleaved in one run.

A random-weight model's continuation means nothing, and it does not repeat its prompt: its greedy output after 32
random tokens four times over holds no n-gram of the prompt, so prompt lookup finds almost nothing to propose. So
acceptance is forced: the `replay` row drafts from a known output of the model (Generator's `proposer`, in place of
prompt lookup), every draft right; the verification, acceptance and draft-length policy are the runtime's own. The
replayed output is the fixed point of replaying: a verification pass computes its tokens' logits in one product of
T rows where decode steps take one row at a time, so a near tie (a random model's top two logits are often
within 1e-3 of each other) may fall the other way and the output part from the plain run's; replayed drafts are
then wrong from there on. So the replay runs again from its own output until that comes back unchanged (every
draft accepted), and the JSON records where each mode's tokens first differ from the plain run's. The figures: our
decode tokens/s with speculation off, with lookup and with the replay, the drafts' acceptance, and llama-bench's
decode tokens/s (-n 32 at depth CTX, flash attention on); the same threads for both.

    .venv/bin/python benchmarks/speculative_llamacpp.py --prepare-only     # the builds, outside the timing lock
    flock /tmp/mla-cpu.lock .venv/bin/python benchmarks/speculative_llamacpp.py [--threads 2] [--new-tokens 128]
        [--draft-tokens 8] [--repeats 3] [--workdir benchmarks/work/llamacpp]
        [--json benchmarks/results/speculative_llamacpp.json]

Steps reuse benchmarks/compare_llamacpp.py: its llama.cpp build, its f32 GGUF (converted once) and llama-quantize
for q4_0 only; the checkpoint is `mla-deploy preset v2lite -o WORK/v2lite-2L --layers 2`, our export
--quantize int4 (block 32, the defaults: embedding and head at 6 bits), as compare_llamacpp's int4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_llamacpp import build, converter_python, cpu_model, gguf_files, llama_bench, llama_tree, log  # noqa: E402


def replay(output: list[int], context: int):
    """A proposer that drafts the next tokens of a known output (after a prompt of `context` tokens)."""

    def propose(history: np.ndarray, k: int) -> list[int]:
        done = len(history) - context  # tokens generated so far, the last one not yet in the cache
        return list(output[done : done + k])

    return propose


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / "work" / "llamacpp")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--prepare-only", action="store_true",
                    help="build llama.cpp, the checkpoint, the GGUF and the export, measure nothing (outside the lock)")
    args = ap.parse_args()
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)

    from mla_deploy.export import ExportOptions, export
    from mla_deploy.presets import build_preset
    from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
    from mla_deploy.runtime.speculative import Speculation

    checkpoint = work / "v2lite-2L"
    if not (checkpoint / "config.json").exists():
        log("mla-deploy preset v2lite --layers 2")
        build_preset("v2lite", checkpoint, 0, 2)
    tree = llama_tree(work)
    bins = build(work, tree)
    gguf = gguf_files(work, tree, bins, converter_python(work), checkpoint, kinds=("q4_0",))["q4_0"]
    ours = work / "export-int4"
    if not (ours / "manifest.json").exists():
        log("exporting int4")
        export(checkpoint, ours, ExportOptions(quantize="int4", force=True))
    if args.prepare_only:
        return 0
    model = ExportedModel(ours, RuntimeOptions(threads=args.threads, prepack=True))
    prompt = np.tile(np.random.default_rng(0).integers(3, model.config.vocab_size, 32), 4).tolist()
    context = len(prompt)
    plain = Generator(model, SamplingParams(), stop_token_ids=()).generate([prompt], args.new_tokens).token_ids[0]
    lookup = Speculation("lookup", args.draft_tokens, min_ngram=1)
    replayed = plain
    for _ in range(8):  # to the fixed point: replaying it gives it back
        again = Generator(model, SamplingParams(), stop_token_ids=(), speculation=lookup,
                          proposer=replay(replayed, context)).generate(
            [prompt], args.new_tokens).token_ids[0]
        if again == replayed:
            break
        replayed = again
    generators = {"off": Generator(model, SamplingParams(), stop_token_ids=()),
                  "lookup": Generator(model, SamplingParams(), stop_token_ids=(), speculation=lookup)}
    generators["replay"] = Generator(model, SamplingParams(), stop_token_ids=(), speculation=lookup,
                                     proposer=replay(replayed, context))
    modes = list(generators)
    results = {"date": date.today().isoformat(), "cpu": cpu_model(), "threads": args.threads,
               "command": " ".join(sys.argv), "context": context, "new_tokens": args.new_tokens,
               "draft_tokens": args.draft_tokens, "llama.cpp": [], **{mode: [] for mode in modes}}
    runs = {}
    for _ in range(args.repeats + 1):  # the first pass warms up
        results["llama.cpp"].append(llama_bench(bins, gguf, args.threads, [context])[f"decode_{context}"])
        for mode, gen in generators.items():
            runs[mode] = gen.generate([prompt], args.new_tokens)
            results[mode].append(runs[mode].decode_tokens_per_s)
        log(f"llama.cpp q4_0 {results['llama.cpp'][-1]:.1f}, "
            + ", ".join(f"{mode} {results[mode][-1]:.1f}" for mode in modes) + " tok/s")
    results["first_difference_from_off"] = {mode: next(
        (i for i, (a, b) in enumerate(zip(plain, runs[mode].token_ids[0])) if a != b), None) for mode in modes}
    keys = ["llama.cpp", *modes]
    for key in keys:
        results[key] = results[key][1:]
    medians = {k: statistics.median(results[k]) for k in keys}
    results["median"] = medians
    results["speculation"] = {mode: runs[mode].speculation.to_dict() for mode in modes if mode != "off"}
    results["vs_llama.cpp"] = {mode: medians[mode] / medians["llama.cpp"] for mode in modes}
    print(f"{results['cpu']}, {args.threads} threads; v2lite-2L, context {context}, {args.new_tokens} new tokens")
    print("| engine | decode tok/s | vs llama.cpp q4_0 | drafts accepted |\n|---|---|---|---|")
    for key in keys:
        label = "llama.cpp q4_0" if key == "llama.cpp" else f"mla-deploy int4, {key}"
        spec = results["speculation"].get(key)
        drafts = f"{spec['accepted']}/{spec['proposed']}" if spec else "-"
        print(f"| {label} | {medians[key]:.1f} | {medians[key] / medians['llama.cpp']:.2f}x | {drafts} |")
    print(f"first token that differs from the plain run's, by mode: {results['first_difference_from_off']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
