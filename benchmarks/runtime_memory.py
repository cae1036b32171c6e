"""Resident memory and speed of an export loaded with each runtime memory option, side by side.

    .venv/bin/python benchmarks/runtime_memory.py EXPORT_DIR [--threads N] [--kernels-off] [--contexts 128,4096]

Memory: each option in its own child process, from /proc/self/smaps_rollup after loading both
sessions, after a 512-token prefill and after 8 decode steps (PSS counts a page of weights.bin that
both sessions map once; RSS twice). Speed: both options loaded in this process, measured alternately
point by point (prefill 512 tokens, decode at each of --contexts, batch 1), so machine noise lands
on both. Options: `prepack` (onnxruntime copies every MatMul weight into a per-session packed
buffer, its default) and `mapped` (prepacking off: both sessions read the one memory-mapped file); with
--kernels-off also `prepack` with mla-deploy's kernels off (RuntimeOptions.kernels: a float16 or bfloat16 export
then multiplies by float32 copies of its weights made at load instead of the stored half-precision ones).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import side_by_side

OPTIONS = {"prepack": {"prepack": True}, "mapped": {"prepack": False}}  # name -> RuntimeOptions fields

CHILD = """
import json, numpy as np, sys
from mla_deploy.runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from mla_deploy.runtime.memory import resident_memory
model = ExportedModel(sys.argv[1], RuntimeOptions(**json.loads(sys.argv[2]), threads=int(sys.argv[3])))
out = {"load_s": model.load_seconds, "loaded": model.load_memory.to_dict()}
gen = Generator(model, SamplingParams(), stop_token_ids=())
prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 512).tolist()
state = gen.new_state([np.asarray(prompt)])
gen.prefill(state, [prompt])
out["prefilled"] = resident_memory().to_dict()
for t in range(8):
    gen.decode_step(state, np.array([t + 5]))
out["decoded"] = resident_memory().to_dict()
print(json.dumps(out))
"""


def memory(directory: str, fields: dict, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, directory, json.dumps(fields), str(threads)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def speed(
    directory: str, options: dict[str, dict], threads: int, contexts: tuple[int, ...]
) -> dict[str, dict[str, float]]:
    from mla_deploy.runtime import ExportedModel, RuntimeOptions

    return side_by_side.speed({name: ExportedModel(directory, RuntimeOptions(**fields, threads=threads))
                               for name, fields in options.items()}, contexts=contexts)


def fitted_contexts(parser: argparse.ArgumentParser, named: str | None, directory: str) -> tuple[int, ...]:
    """The speed table's contexts: each leaves room for side_by_side's timed steps within the export's length; a
    default one past it is measured at the longest that fits, a named one is refused."""
    from mla_deploy.manifest import read_manifest

    longest = read_manifest(directory)["max_seq_len"] - side_by_side.steps_room()
    try:
        contexts = tuple(int(c) for c in (named or "128,4096").split(","))
    except ValueError:
        parser.error(f"--contexts {named}: expected comma-separated integers")
    if named and (min(contexts) < 1 or max(contexts) > longest):
        parser.error(f"--contexts {named}: each must be in [1, {longest}] (the export's length less the timed steps)")
    return tuple(dict.fromkeys(min(c, longest) for c in contexts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export_dir")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--kernels-off", action="store_true", help="prepack also with mla-deploy's kernels off")
    parser.add_argument("--contexts", default=None, help="decode contexts of the speed table (default 128,4096; "
                        "past the export's length: the longest that fits)")
    args = parser.parse_args()
    contexts = fitted_contexts(parser, args.contexts, args.export_dir)
    options = dict(OPTIONS)
    if args.kernels_off:
        options["prepack, kernels off"] = {**OPTIONS["prepack"], "kernels": False}
    weights = (Path(args.export_dir) / "weights.bin").stat().st_size
    print(f"weights.bin {weights / 1e9:.2f} GB")
    print(
        "| option | load s | after load PSS / RSS / anon GB | after prefill 512 | after 8 decode steps | PSS / "
        "weights |"
    )
    print("|---|---|---|---|---|---|")
    for name, fields in options.items():
        m = memory(args.export_dir, fields, args.threads)
        cells = [
            " / ".join(f"{m[k][f] / 1e9:.2f}" for f in ("pss", "rss", "anonymous"))
            for k in ("loaded", "prefilled", "decoded")
        ]
        print(f"| {name} | {m['load_s']:.1f} | {' | '.join(cells)} | {m['decoded']['pss'] / weights:.2f} |", flush=True)
    print()
    others = list(options)[1:]
    print(
        "| point | "
        + " | ".join(f"{n} ms" for n in options)
        + " | "
        + " | ".join(f"{n} / prepack" for n in others)
        + " |"
    )
    print("|---" * (1 + len(options) + len(others)) + "|")
    for point, by in speed(args.export_dir, options, args.threads, contexts).items():
        print(f"| {point} | " + " | ".join(f"{by[n]:.1f}" for n in options) + " | "
              + " | ".join(f"{by[n] / by['prepack']:.2f}" for n in others) + " |")


if __name__ == "__main__":
    main()
