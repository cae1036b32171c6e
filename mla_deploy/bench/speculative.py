"""Speculative decoding's figures: decode tokens/s and draft acceptance per mode (off, lookup, mtp) over the same
prompts, the modes interleaved within each repeat so that every ratio comes from one run.

Prompts: "repeating", a random token sequence four times over (what prompt lookup feeds on, for any checkpoint,
random weights included); with a tokenizer, "restated code", a piece of Python source followed by the request to
write it again and its first line (prompt lookup's use: the output restates the input); and any texts given.
Greedy decoding, so every mode emits the same tokens (checked: a mode whose tokens differ from off's is an error).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

RESTATED = Path(__file__).resolve().parents[1] / "runtime" / "cache.py"  # the source the restated-code prompt quotes


def prompts(model, texts: dict[str, str] | None = None, seed: int = 0) -> dict[str, list[int]]:
    """The benchmark's prompts for `model` (an ExportedModel): name -> token ids."""
    from ..runtime.text import Tokenizer

    rng = np.random.default_rng(seed)
    out = {"repeating": np.tile(rng.integers(3, model.config.vocab_size, 32), 4).tolist()}
    tokenizer = Tokenizer.from_export(model.directory, model.manifest)
    if tokenizer is not None:
        code = RESTATED.read_text()
        piece = code[code.index("class CacheBuffers") :][:1200]
        out["restated code"] = tokenizer.encode(piece + "\n\n\n# The same class again, unchanged:\n"
                                                + piece.splitlines()[0] + "\n")
        for name, text in (texts or {}).items():
            out[name] = tokenizer.encode(text)
    return out


def speculative_rows(export_dir: Path, modes: tuple[str, ...], threads: int, new_tokens: int = 128,
                     draft_tokens: int = 4, repeats: int = 3, texts: dict[str, str] | None = None,
                     progress=lambda msg: None) -> list[dict]:
    """One row per prompt and mode: the median decode tokens/s over `repeats`, the ratio to off's, the acceptance of
    the draft tokens and of each step's first one."""
    from ..errors import MLADeployError
    from ..runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
    from ..runtime.speculative import Speculation

    model = ExportedModel(export_dir, RuntimeOptions(threads=threads, prepack=True))
    new_tokens = min(new_tokens, model.max_seq_len // 2)  # a short export: half for the prompt, half for the output
    if "mtp" in modes and not model.has_draft:
        progress(f"{export_dir.name}: mtp left out: the export has no draft graph (its checkpoint has no MTP layer)")
        modes = tuple(m for m in modes if m != "mtp")
    generators = {m: Generator(model, SamplingParams(), stop_token_ids=(), speculation=Speculation(m, draft_tokens))
                  for m in modes}
    rows = []
    for name, ids in prompts(model, texts).items():
        ids = ids[: model.max_seq_len - new_tokens]
        speeds = {m: [] for m in modes}
        last = {}
        for _ in range(repeats + 1):  # the first pass warms up (and measures the draft policy's costs)
            for mode in modes:
                last[mode] = generators[mode].generate([ids], new_tokens)
                speeds[mode].append(last[mode].decode_tokens_per_s)
        for mode in modes:
            if last[mode].token_ids != last[modes[0]].token_ids:
                raise MLADeployError(f"{name}: greedy tokens with speculation {mode} differ from {modes[0]}'s")
            spec = last[mode].speculation
            speed = statistics.median(speeds[mode][1:])
            rows.append({"prompt": name, "prompt_tokens": len(ids), "new_tokens": new_tokens, "mode": mode,
                         "resolved": generators[mode].speculation.mode,  # what auto became on this machine
                         "draft_tokens": draft_tokens if mode != "off" else 0, "tokens_per_s": speed,
                         **(spec.to_dict() if spec else {})})
            progress(f"speculative {name}: {mode} {speed:.1f} tok/s"
                     + (f", acceptance {spec.to_dict()['acceptance']}" if spec else ""))
        base = next((r["tokens_per_s"] for r in rows if r["prompt"] == name and r["mode"] == "off"), None)
        for r in rows:
            if r["prompt"] == name and base:
                r["vs_off"] = r["tokens_per_s"] / base
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [f"{'prompt':<16}{'mode':<16}{'tok/s':>9}{'vs off':>8}{'accepted':>12}{'first token':>13}"]
    for r in rows:
        accepted = f"{r['accepted']}/{r['proposed']}" if r.get("proposed") else "-"
        first = f"{r['first_token_acceptance']:.2f}" if r.get("first_token_acceptance") is not None else "-"
        mode = r["mode"] if r.get("resolved", r["mode"]) == r["mode"] else f"{r['mode']} ({r['resolved']})"
        lines.append(f"{r['prompt']:<16}{mode:<16}{r['tokens_per_s']:>9.1f}{r.get('vs_off', 0):>7.2f}x"
                     f"{accepted:>12}{first:>13}")
    return lines
