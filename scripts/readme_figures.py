"""The figures README.md states, rendered from benchmarks/results/*.json: the README never carries a hand-copied figure.

    .venv/bin/python scripts/readme_figures.py            # print the rendered blocks
    .venv/bin/python scripts/readme_figures.py --write    # write them into README.md
    .venv/bin/python scripts/readme_figures.py --check    # exit 1 (with a diff) where README.md differs

A rendered block sits between `<!-- figures: NAME ... -->` and `<!-- /figures -->`; everything between the two
markers belongs to this script (tests/test_docs.py fails when README.md differs from what it renders).

Blocks:
- `llamacpp-summary`: ours / llama.cpp tokens/s per precision pair (prefill 512, decode at contexts 128 / 4096 /
  16384, batch 8), from `benchmarks/results/llamacpp*.json` as `benchmarks/compare_llamacpp.py` writes them. Each
  precision comes from the latest file holding it (by its date; on the same date the file with fewer pairs wins: a
  `--pairs` run re-measures a subset after the full one), with that file's date and machine.
- `llamacpp-full-size`: the same for the full-size DeepSeek-V2-Lite, from
  `benchmarks/results/full-size-llamacpp*.json` (`compare_llamacpp.py --preset v2lite --convert q8_0`); a figure
  the run did not measure says so.
- `gpu`: onnxruntime's CUDA provider against transformers on the same GPU, from `benchmarks/results/gpu.json`
  (`benchmarks/gpu.py`): the exports verified, and the headline export's decode at batch 1 and 64, context 128.

A result file's date is its "date" field; a file without one is dated by git: today where the working tree changes
it (a measurement about to be committed), else the day of the last commit that changed it. A shallow clone cannot
date it and is refused.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"

SUMMARY_ORDER = ("int8", "int4", "int4-head8", "int4-head4", "float16")  # our precisions' names, as in the JSON
# A pair that records no "head_bits" names its int4 exports by their heads as its file's command made them: "int4"
# with the embedding and head at 8 bits, "int4-head6" at 6 (int4's default head).
NAMES_WITHOUT_HEAD_BITS = {"int4": "int4-head8", "int4-head6": "int4"}
COLUMNS = (("prefill_512", "prefill 512"), ("decode_128", "decode, ctx 128"), ("decode_4096", "ctx 4096"),
           ("decode_16384", "ctx 16384"), ("batch8_128", "batch 8, ctx 128"))
LABELS = {"int4-head8": "int4 `--head-bits 8`", "int4-head4": "int4 `--head-bits 4`"}
BLOCK = re.compile(r"(<!-- figures: (?P<name>[\w-]+)[^>]*-->\n)(?P<body>.*?)(<!-- /figures -->)", re.S)


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def measured_on(path: Path, data: dict) -> str:
    """The date (YYYY-MM-DD) the figures in `path` were measured: its "date" field, else git's record of the file."""
    if data.get("date"):
        return str(data["date"])
    rel = str(path.relative_to(ROOT))
    if _git("status", "--porcelain", "--", rel):  # changed in the working tree: measured just now
        return datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    if _git("rev-parse", "--is-shallow-repository") == "true":
        raise SystemExit(f"{rel}: no \"date\" field, and a shallow clone cannot date it from git history")
    day = _git("log", "-1", "--format=%cs", "--", rel)
    if not day:
        raise SystemExit(f"{rel}: no \"date\" field and no commit to date it by")
    return day


def machine(data: dict) -> str:
    """The machine a llama.cpp comparison ran on, as the file records it."""
    return f"{data.get('cpu', 'CPU not recorded')}, {data.get('threads', '?')} threads"


def llamacpp_pairs(results: Path = RESULTS, pattern: str = "llamacpp*.json") -> dict[str, dict]:
    """{our precision: its latest pair among the files matching `pattern`, with 'date', 'machine' and 'source'
    added}."""
    best: dict[str, tuple] = {}
    for path in sorted(results.glob(pattern)):
        data = json.loads(path.read_text())
        day = measured_on(path, data)
        for pair in data["pairs"]:
            name = pair["mla_deploy"] if "head_bits" in pair else NAMES_WITHOUT_HEAD_BITS.get(pair["mla_deploy"],
                                                                                          pair["mla_deploy"])
            key = (day, data.get("time", ""), -len(data["pairs"]))  # the later run of a day, else the narrower
            if name not in best or key > best[name][0]:
                best[name] = (key, {**pair, "date": day, "machine": machine(data), "source": path.name})
    return {name: entry for name, (_, entry) in best.items()}


def _tokens_per_s(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _ratio(ours: float, theirs: float) -> str:
    ratio = ours / theirs
    text = f"{ratio:.2f}x ({_tokens_per_s(ours)} / {_tokens_per_s(theirs)})"
    return f"**{text}**" if ratio < 1 else text  # bold where llama.cpp is faster


def _pairs_table(pairs: dict[str, dict], names: list[str]) -> str:
    head = ["mla-deploy vs llama.cpp", *(title for _, title in COLUMNS), "measured"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        pair = pairs[name]
        cells = [f"{LABELS.get(name, name)} vs {pair['llama.cpp']}"]
        cells += [_ratio(pair["ours"][key], pair["theirs"][key]) if key in pair["theirs"] else "not measured"
                  for key, _ in COLUMNS]
        rounds = len(pair.get("decode_128_rounds", ()))  # compare_llamacpp --rounds: ctx 128 is their median
        cells.append(f"{pair['date']}, {pair['machine']} (`{pair['source']}`"
                     + (f"; ctx 128: median of {rounds} rounds)" if rounds else ")"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def llamacpp_summary(results: Path = RESULTS) -> str:
    """Every precision pair on `v2lite-2L` (benchmarks/results/llamacpp*.json)."""
    pairs = llamacpp_pairs(results)
    missing = [name for name in SUMMARY_ORDER if name not in pairs]
    if missing:
        raise SystemExit(f"benchmarks/results/llamacpp*.json: no measurement of {', '.join(missing)}")
    return _pairs_table(pairs, list(SUMMARY_ORDER))


def llamacpp_full_size(results: Path = RESULTS) -> str:
    """The pairs measured on the full-size V2-Lite (benchmarks/results/full-size-llamacpp*.json)."""
    pairs = llamacpp_pairs(results, "full-size-llamacpp*.json")
    if not pairs:
        raise SystemExit("benchmarks/results/full-size-llamacpp*.json: no full-size measurement")
    return _pairs_table(pairs, [name for name in SUMMARY_ORDER if name in pairs])


def gpu(results: Path = RESULTS) -> str:
    """The CUDA run (benchmarks/results/gpu.json): verify outcomes, and decode of the first export timed."""
    path = results / "gpu.json"
    data = json.loads(path.read_text())
    jobs = data["jobs"]
    verified = [key.split(" ", 1)[1] for key in jobs if key.startswith("verify ") and "passed" in jobs[key]]
    passed = [name for name in verified if jobs[f"verify {name}"]["passed"]]
    rates = {key: value for key, value in jobs.items() if key.startswith("decode ") and "tokens_per_s" in value}
    if not rates:
        raise SystemExit(f"{path.name}: no decode measured")
    first = next(iter(rates))  # "decode MODEL/DTYPE/FORM batch B ctx C"
    export = first.split(" ")[1]
    model = export.split("/")[0]
    # batch 1 at 4k where both engines have it: each process's first timed point (ctx 128) runs slow
    ctx = 4096 if f"decode {export} batch 1 ctx 4096" in rates and "tokens_per_s" in jobs.get(
        f"peer {model} eager batch 1 ctx 4096", {}) else 128
    one, wide = rates.get(f"decode {export} batch 1 ctx {ctx}"), rates.get(f"decode {export} batch 64 ctx 128")
    eager, compiled = (jobs.get(f"peer {model} {how} batch 1 ctx {ctx}", {}) for how in ("eager", "compiled"))
    head = ["on onnxruntime's CUDA provider", "verify",
            f"decode batch 1, ctx {ctx} vs transformers bf16 eager" + (
                " / torch.compile" if "tokens_per_s" in compiled else ""),
            "batch 64, ctx 128", "measured"]
    if one and "tokens_per_s" in eager and "tokens_per_s" in compiled:
        ratios = [one["tokens_per_s"] / peer["tokens_per_s"] for peer in (eager, compiled)]
        decode = " / ".join(f"**{r:.2f}x**" if r < 1 else f"{r:.2f}x" for r in ratios) + (
            f" ({_tokens_per_s(one['tokens_per_s'])} / {_tokens_per_s(eager['tokens_per_s'])} / "
            f"{_tokens_per_s(compiled['tokens_per_s'])})")
    else:
        decode = (_ratio(one["tokens_per_s"], eager["tokens_per_s"]) if one and "tokens_per_s" in eager
                  else f"{_tokens_per_s(one['tokens_per_s'])} tokens/s" if one else "not measured")
    cells = [f"`{export}`, {jobs['environment'].get('device', 'device not recorded')}",
             f"{len(passed)} of {len(verified)} exports pass", decode,
             f"{_tokens_per_s(wide['tokens_per_s'])} tokens/s" if wide else "not measured",
             f"{data.get('date') or data['updated'][:10]} (`{path.name}`)"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(cells) + " |"]) + "\n"


RENDERERS = {"llamacpp-summary": llamacpp_summary, "llamacpp-full-size": llamacpp_full_size, "gpu": gpu}


def render(text: str, results: Path = RESULTS) -> str:
    """`text` with every figures block re-rendered; an unknown block name is an error."""
    def block(match: re.Match) -> str:
        name = match["name"]
        if name not in RENDERERS:
            raise SystemExit(f"unknown figures block {name!r} (known: {', '.join(RENDERERS)})")
        return match[1] + RENDERERS[name](results) + match[4]

    return BLOCK.sub(block, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the rendered blocks into README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 where README.md differs from the rendering")
    args = parser.parse_args(argv)
    text = README.read_text()
    rendered = render(text)
    if args.write:
        README.write_text(rendered)
    elif args.check:
        diff = list(difflib.unified_diff(text.splitlines(True), rendered.splitlines(True), "README.md", "rendered"))
        sys.stdout.writelines(diff)
        return 1 if diff else 0
    else:
        for name, renderer in RENDERERS.items():
            print(f"<!-- figures: {name} -->\n{renderer()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
