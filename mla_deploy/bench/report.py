"""Benchmark output: the table, the target summary, the JSON file and the chart."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import MLADeployError
from ..partial import scratch_path, unwritable_parent

from .run import BenchResult


def table(result: BenchResult) -> str:
    bw = result.bandwidth_gbs
    lines = [
        f"machine: {result.machine['cpu']}, {result.machine['threads']} threads, "
        f"onnxruntime {result.machine['onnxruntime']}",
        "bandwidth (GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in bw.items()),
        "",
        f"{'engine':<20}{'ctx':>7}{'batch':>6}{'ms/step':>10}{'tok/s':>9}{'of limit':>10}"
        f"{'cache B/tok':>13}{'rss MB':>8}",
    ]
    for r in result.rows:
        if "skipped" in r:
            lines.append(f"{r['engine']:<20}{r['ctx']:>7}{r['batch']:>6}  skipped: {r['skipped']}")
            continue
        frac = f"{r['fraction_of_limit']:.2f}" if "fraction_of_limit" in r else "-"
        lines.append(f"{r['engine']:<20}{r['ctx']:>7}{r['batch']:>6}{r['step_ms']:>10.2f}{r['tokens_per_s']:>9.1f}"
                     f"{frac:>10}{r['cache_bytes_per_token']:>13}{r['rss_mb']:>8}")
    lines.append(
        "(of limit: the bytes a step reads (weights and cache) x steps/s over the highest bandwidth probed above; "
        "weights that fit in the CPU's caches read faster than memory: above 1.00)"
    )
    lines.append(
        "(rss MB: resident memory the engine added: the absorbed exports, loaded side by side, show what their "
        "load added; the others the growth from their load through that point)"
    )
    if result.prefill:
        lines += ["", f"{'engine':<20}{'prefill tokens':>15}{'tok/s':>9}"]
        lines += [f"{p['engine']:<20}{p['tokens']:>15}{p['tokens_per_s']:>9.1f}" for p in result.prefill]
    if result.speculative:
        from .speculative import table as speculative_table

        lines += [
            "",
            "speculative decoding (greedy, the same tokens in every mode):",
            *speculative_table(result.speculative),
        ]
    lines += ["", *targets(result), "", f"run time {result.seconds:.0f} s"]
    return "\n".join(lines)


def _step(result, engine, ctx, batch=1):
    for r in result.rows:
        if (r["engine"], r["ctx"], r["batch"]) == (engine, ctx, batch) and "step_ms" in r:
            return r
    return None


def targets(result: BenchResult) -> list[str]:
    """Each target of the benchmark issue that this run measured, with the figure and whether it holds."""
    out = ["targets (measured in this run):"]

    def check(label, value, ok, fmt="{:.2f}"):
        if value is not None:
            out.append(f"  {'met ' if ok(value) else 'MISS'}  {label}: {fmt.format(value)}")

    best = max(("onnx-fused", "onnx-factored"),
               key=lambda e: (_step(result, e, 128) or {}).get("tokens_per_s", 0))
    r128 = _step(result, best, 128)
    check(f"{best} decode at ctx 128, fraction of the bandwidth limit (>= 0.9)",
          r128 and r128.get("fraction_of_limit"), lambda v: v >= 0.9)
    r16k = _step(result, best, 16384)
    check(
        f"{best} step at 16k / step at 128 (<= 1.15)",
        r16k and r128 and r16k["step_ms"] / r128["step_ms"],
        lambda v: v <= 1.15,
    )
    hf4k, ours4k = _step(result, "transformers", 4096), _step(result, best, 4096)
    check(
        "decode at 4k vs transformers (>= 15x)",
        hf4k and ours4k and hf4k["step_ms"] / ours4k["step_ms"],
        lambda v: v >= 15,
        "{:.1f}x",
    )
    mha16k = _step(result, "onnx-mha-baseline", 16384)
    check("decode at 16k vs decompressed-K/V ONNX (>= 4x)", mha16k and r16k and mha16k["step_ms"] / r16k["step_ms"],
          lambda v: v >= 4, "{:.1f}x")
    mha, ours = _step(result, "onnx-mha-baseline", 128), r128
    check("cache bytes per token, decompressed / latent (= n_h(d_nope+d_r+d_v)/(d_c+d_r))",
          mha and ours and mha["cache_bytes_per_token"] / ours["cache_bytes_per_token"],
          lambda v: True, "{:.2f}x")
    pre = [p for p in result.prefill if p["engine"] == best]
    check(
        f"{best} prefill of 512 tokens (>= 850 tok/s)",
        pre[0]["tokens_per_s"] if pre else None,
        lambda v: v >= 850,
        "{:.0f} tok/s",
    )
    b8 = _step(result, best, 128, 8)
    check(
        "batch 8 vs batch 1 decode tokens/s at ctx 128 (>= 5x)",
        b8 and r128 and b8["tokens_per_s"] / r128["tokens_per_s"],
        lambda v: v >= 5,
        "{:.1f}x",
    )
    start = result.runtime_start
    if start:
        total = start["import_s"] + start["load_s"]
        check(
            f"runtime import + load of a small export ({start['export']}), torch imported: "
            f"{start['torch_imported']} (< 1 s)",
            total,
            lambda v: v < 1 and not start["torch_imported"],
            "{:.2f} s",
        )
    return out


def check_destination(directory: Path) -> None:
    """Refuse before a benchmark runs where its results could not be saved: `directory` a file, or not creatable."""
    if directory.exists() and not directory.is_dir():
        raise MLADeployError(f"--out {directory}: is a file; results.json and results.png go in a directory")
    if not directory.exists() and (why := unwritable_parent(directory)) is not None:
        raise MLADeployError(f"--out {directory}: cannot be created ({why})")
    if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
        raise MLADeployError(f"--out {directory}: is not writable")


def save(result: BenchResult, directory: Path, name: str = "results") -> tuple[Path, Path | None]:
    """results.json (whole or not at all: written beside, then renamed) and its chart in `directory`."""
    json_path = directory / f"{name}.json"
    partial = scratch_path(json_path, "partial")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial.write_text(result.to_json() + "\n")
        partial.replace(json_path)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise MLADeployError(f"--out {directory}: cannot save the results ({e.strerror or e})") from None
    return json_path, chart(result, directory / f"{name}.png")


def chart(result: BenchResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for engine in dict.fromkeys(r["engine"] for r in result.rows):
        pts = sorted((r["ctx"], r["tokens_per_s"]) for r in result.rows
                     if r["engine"] == engine and r["batch"] == 1 and "tokens_per_s" in r)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=engine)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"decode speed, {result.machine['cpu'][:48]}, {result.machine['threads']} threads", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(result: BenchResult) -> str:
    """The README's tables: decode tokens/s per engine and context for each batch size, then prefill."""
    engines = list(dict.fromkeys(r["engine"] for r in result.rows))
    contexts = sorted({r["ctx"] for r in result.rows})
    out = []
    for batch in sorted({r["batch"] for r in result.rows}):
        out += [
            f"Decode tokens/s, batch {batch} (step ms in brackets; fraction of the bandwidth limit for the ONNX "
            f"engines):",
            "",
            "| engine | " + " | ".join(f"ctx {c}" for c in contexts) + " |",
            "|---|" + "---|" * len(contexts),
        ]
        for engine in engines:
            cells = []
            for c in contexts:
                r = next((r for r in result.rows if (r["engine"], r["ctx"], r["batch"]) == (engine, c, batch)), None)
                if r is None or "step_ms" not in r:
                    cells.append("skipped" if r else "-")
                    continue
                frac = f", {r['fraction_of_limit']:.2f}" if "fraction_of_limit" in r else ""
                cells.append(f"{r['tokens_per_s']:.1f} ({r['step_ms']:.0f} ms{frac})")
            out.append(f"| {engine} | " + " | ".join(cells) + " |")
        out.append("")
    if result.prefill:
        out += [
            "Prefill of 512 tokens (tokens/s): "
            + ", ".join(f"{p['engine']} {p['tokens_per_s']:.0f}" for p in result.prefill),
            "",
        ]
    return "\n".join(out)
