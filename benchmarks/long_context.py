"""Long context on one checkpoint (default `v2lite-2L`): mla-deploy's int4 exports with the float32 and the int8
latent cache against llama.cpp's q4_0 with its default f16 cache and with `-ctk q8_0 -ctv q8_0`, on the same
weights, at a long context (default 16384) and a short one (128).

  decode:  our step at the long context / our step at 128, per export (the cost of the context); our decode tokens/s
           at the long context against llama-bench's `tg16 @ d16384`, per llama.cpp cache type;
  prefill: 512 prompt tokens prefilled on top of the long context (our prefill graph in the Generator's 512-token
           chunks, each over the whole cache before it) against llama-bench's `pp512 @ d16384`.

Every measurement is its own segment under the machine's CPU lock (`flock /tmp/mla-cpu.lock`, so no two benchmarks
overlap) and segments alternate, ours and llama.cpp's, `--rounds` times; medians are reported, with the load
average at each segment (llama.cpp's OpenMP threads lose far more than onnxruntime's when other processes share the
cores: figures taken under load say little). llama-bench fills its cache with `-d` tokens of prompt before every
test, so each of its long-context segments takes minutes.

Setup, each step skipped when its output exists, in WORK (default benchmarks/work/llamacpp, shared with
benchmarks/compare_llamacpp.py, whose helpers build llama.cpp and convert the checkpoint): the q4_0 GGUF, and our
exports `export-int4` and `export-int4-q8cache` (int4 block 32, --cache-dtype int8).

    .venv/bin/python benchmarks/long_context.py [--checkpoint DIR | --preset v2lite-2L] [--threads 2]
        [--context 16384] [--rounds 2] [--workdir benchmarks/work/llamacpp] [--out benchmarks/results/long_context.json]

The full-size measurement (DeepSeek-V2-Lite, int4 weights, the int8 cache; the decode graph only, on the quantized
kernels that keep one copy of the weights): the longest context whose cache fits beside the loaded model in the
machine's memory, and decode tokens/s at 32k:

    .venv/bin/python benchmarks/long_context.py --full-size EXPORT [--contexts 4096,32768] [--memory-gb 23.5]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare_llamacpp as llamacpp  # noqa: E402

LOCK = "/tmp/mla-cpu.lock"
EXPORTS = {"int4": {"quantize": "int4"}, "int4-q8cache": {"quantize": "int4", "cache_dtype": "int8"}}
CACHES = ("f16", "q8_0")  # llama.cpp's K and V cache types
PROMPT = 512


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def cpu_lock():
    """One measurement segment: the machine's CPU lock held, and the load average when it was taken."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield os.getloadavg()[0]
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def exports(work: Path, checkpoint: Path) -> dict[str, Path]:
    from mla_deploy.export import ExportOptions, export

    out = {}
    for name, options in EXPORTS.items():
        out[name] = work / f"export-{name}"
        if not (out[name] / "manifest.json").exists():
            log(f"exporting {name}")
            export(checkpoint, out[name], ExportOptions(force=True, **options), progress=lambda m: None)
    return out


def llama_bench(bins: Path, gguf: Path, threads: int, cache: str, test: list[str], context: int) -> float:
    """tokens/s of one llama-bench test (`-p 512 -n 0` or `-p 0 -n 16`) at depth `context` with K and V cached in
    `cache`; one repetition (the fill of the depth dominates)."""
    cmd = [bins / "llama-bench", "-m", gguf, "-t", threads, "-fa", "1", "-r", "1", "-ctk", cache, "-ctv", cache,
           *test, "-d", context, "-o", "json"]
    env = {**os.environ, "LD_LIBRARY_PATH": str(bins)}
    out = llamacpp.run(cmd, capture_output=True, text=True, env=env).stdout
    return json.loads(out)[0]["avg_ts"]


def ours_decode(engine, contexts: list[int], steps: int) -> dict[int, float]:
    """The median step at each context, the contexts' steps in turn (their ratio then sees one machine state)."""
    return engine.interleaved_step_ms(contexts, steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--preset", default="v2lite-2L")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40, help="our timed decode steps per point")
    ap.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / "work" / "llamacpp")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "long_context.json")
    ap.add_argument("--full-size", type=Path, default=None, help="an int4, int8-cache export of the full model")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--memory-gb", type=float, default=23.5)
    args = ap.parse_args()
    if args.full_size is not None:
        return full_size(args)
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    from mla_deploy.presets import build_preset

    checkpoint = args.checkpoint or build_preset(args.preset, work / args.preset)  # reused once written
    bins = llamacpp.build(work, llamacpp.llama_tree(work))
    gguf = work / "model-q4_0.gguf"
    if not gguf.exists():
        tree, python = llamacpp.llama_tree(work), llamacpp.converter_python(work)
        gguf = llamacpp.gguf_files(work, tree, bins, python, checkpoint, kinds=("q4_0",))["q4_0"]
    ours = exports(work, checkpoint)

    from mla_deploy.bench.engines import OnnxEngine

    engines = {}
    for name, directory in ours.items():
        engines[name] = OnnxEngine(name, directory, args.threads)
        engines[name].load()
    ctx, short = args.context, 128
    rows: list[dict] = []
    for round_ in range(args.rounds):
        for name, engine in engines.items():
            with cpu_lock() as load:
                log(f"round {round_ + 1}: ours {name}, decode at {short} and {ctx}, prefill {PROMPT} at {ctx}")
                steps = ours_decode(engine, [short, ctx], args.steps)
                engine.prefill_at_context_s(PROMPT, ctx)  # warm up
                prefill = min(engine.prefill_at_context_s(PROMPT, ctx) for _ in range(2))
            rows.append(
                {
                    "engine": name,
                    "round": round_,
                    "load": load,
                    "decode_ms": {str(k): v for k, v in steps.items()},
                    "prefill_tokens_per_s": PROMPT / prefill,
                }
            )
        for cache in CACHES:
            for test, key in ((["-p", "0", "-n", "16"], "decode_tokens_per_s"), (["-p", str(PROMPT), "-n", "0"],
                                                                                   "prefill_tokens_per_s")):
                with cpu_lock() as load:
                    log(f"round {round_ + 1}: llama.cpp q4_0, {cache} cache, {' '.join(test)} at depth {ctx}")
                    rows.append({"engine": f"llama.cpp q4_0 {cache} cache", "round": round_, "load": load,
                                 key: llama_bench(bins, gguf, args.threads, cache, test, ctx)})
    results = {"date": time.strftime("%Y-%m-%d"), "cpu": llamacpp.cpu_model(), "threads": args.threads,
               "context": ctx, "checkpoint": str(checkpoint), "rows": rows}
    results["summary"] = summary(rows, ctx, short)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print_summary(results)
    return 0


def summary(rows: list[dict], ctx: int, short: int) -> dict:
    """Medians over the rounds, and the ratios the goals name."""
    def median(engine, key, sub=None):
        values = [r[key][sub] if sub else r[key] for r in rows if r["engine"] == engine and key in r]
        return statistics.median(values)

    s = {}
    for name in EXPORTS:
        s[name] = {"step_ms": {str(c): median(name, "decode_ms", str(c)) for c in (short, ctx)},
                   "prefill_tokens_per_s": median(name, "prefill_tokens_per_s")}
        s[name]["step_ratio"] = s[name]["step_ms"][str(ctx)] / s[name]["step_ms"][str(short)]
        s[name]["decode_tokens_per_s"] = 1e3 / s[name]["step_ms"][str(ctx)]
    for cache in CACHES:
        theirs = f"llama.cpp q4_0 {cache} cache"
        s[theirs] = {"decode_tokens_per_s": median(theirs, "decode_tokens_per_s"),
                     "prefill_tokens_per_s": median(theirs, "prefill_tokens_per_s")}
    for name in EXPORTS:
        for cache in CACHES:
            theirs = s[f"llama.cpp q4_0 {cache} cache"]
            s[name][f"vs {cache}"] = {
                k: s[name][k] / theirs[k] for k in ("decode_tokens_per_s", "prefill_tokens_per_s")
            }
    return s


def print_summary(results: dict) -> None:
    s, ctx = results["summary"], results["context"]
    print(f"{results['cpu']}, {results['threads']} threads, {results['date']}; load averages "
          f"{min(r['load'] for r in results['rows']):.1f}-{max(r['load'] for r in results['rows']):.1f}")
    print(f"| | step 128 ms | step {ctx} ms | ratio | decode tok/s at {ctx} | prefill {PROMPT} at {ctx} tok/s |")
    print("|---|---|---|---|---|---|")
    for name in EXPORTS:
        r = s[name]
        print(f"| ours {name} | {r['step_ms']['128']:.1f} | {r['step_ms'][str(ctx)]:.1f} | {r['step_ratio']:.2f} | "
              f"{r['decode_tokens_per_s']:.1f} | {r['prefill_tokens_per_s']:.1f} |")
    for cache in CACHES:
        r = s[f"llama.cpp q4_0 {cache} cache"]
        print(
            f"| llama.cpp q4_0, {cache} cache | | | | {r['decode_tokens_per_s']:.1f} | "
            f"{r['prefill_tokens_per_s']:.1f} |"
        )
    for name in EXPORTS:
        for cache in CACHES:
            v = s[name][f"vs {cache}"]
            print(f"ours {name} / llama.cpp {cache} cache: decode {v['decode_tokens_per_s']:.2f}x, prefill "
                  f"{v['prefill_tokens_per_s']:.2f}x")


def full_size(args) -> int:
    """The full model, decode graph only: memory after load, the longest context whose cache fits in the rest of the
    machine's memory at batch 1, and decode tokens/s at each of --contexts that fits."""
    from mla_deploy.bench.engines import OnnxEngine
    from mla_deploy.runtime.memory import resident_memory

    engine = OnnxEngine("full", args.full_size, args.threads)
    with cpu_lock() as load:
        engine.load(graphs=("decode",))
    loaded = resident_memory()
    per_token = engine.cache_bytes_per_token()
    # the weights are mapped, resident as decode reads them: the cache gets what is left beside all of them
    weights = (Path(args.full_size) / "weights.bin").stat().st_size
    room = args.memory_gb * 1e9 - weights - loaded.anonymous
    result = {"date": time.strftime("%Y-%m-%d"), "cpu": llamacpp.cpu_model(), "export": str(args.full_size),
              "cache": engine.model.cache_format.latent, "cache_bytes_per_token": per_token,
              "rss_after_load_gb": loaded.rss / 1e9, "weights_gb": weights / 1e9,
              "max_context": min(int(room // per_token), engine.model.max_seq_len),
              "memory_holds_context": int(room // per_token), "load": load, "decode_tokens_per_s": {}}
    for ctx in (int(c) for c in args.contexts.split(",")):
        if ctx > result["max_context"] or ctx + args.steps + 2 > engine.model.max_seq_len:
            log(f"context {ctx}: beyond the {result['max_context']} slots {room / 1e9:.1f} GB hold or the export's "
                f"maximum length {engine.model.max_seq_len}")
            continue
        with cpu_lock() as load:
            result["decode_tokens_per_s"][str(ctx)] = 1e3 / engine.decode_step_ms(ctx, 1, args.steps)
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_name(args.out.stem + "_full_size.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
