"""What cache reuse past a common start (the scheduler's `cache_reuse`, `chat --cache-reuse`, `serve --cache-reuse`)
saves and what it costs, side by side in one run.

  speed:   a row holds START + DROPPED + KEPT (a chat whose context filled); the next prompt is START + KEPT + NEW
           (its oldest turns dropped). Time to its first token with the KEPT slots moved up (runtime.prefix.moved_runs)
           against prefilling KEPT again (prefix caching of START alone, what the scheduler does without the option),
           on the same scheduler settings, alternating, each the median of --repeats; and the move alone
           (CacheBuffers.move_slots).
  quality: on text (default: the demo model and its held-out text), windows of START + DROPPED + KEPT + SCORED
           tokens (16 + 48 + 128 + 64 and 16 + 112 + 96 + 32: 256, the demo's training length): SCORED's next-token
           NLL and top-1 over the moved cache against the same over a fresh prefill of START + KEPT (the exact
           answer): perplexity ratio exp(mean NLL difference) and top-1 agreement; and, for scale, the same over the
           whole window never dropped (what the moved slots still carry of DROPPED).

    .venv/bin/python benchmarks/cache_reuse.py --speed EXPORT [--context 4096] [--dropped 1024] [--repeats 3]
        [--quality EXPORT (default: the demo model exported under benchmarks/work/cache_reuse)] [--text FILE]
        [--out benchmarks/results/cache_reuse.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mla_deploy import io_spec  # noqa: E402
from mla_deploy.bench.run import machine_info  # noqa: E402
from mla_deploy.presets import DEMO_CHECKPOINT  # noqa: E402
from mla_deploy.runtime import ExportedModel, SamplingParams, Tokenizer  # noqa: E402
from mla_deploy.runtime.cache import CacheBuffers  # noqa: E402
from mla_deploy.runtime.prefix import Moved  # noqa: E402
from mla_deploy.runtime.scheduler import Request, Scheduler, TokenEvent  # noqa: E402
from mla_deploy.runtime.scoring import log_softmax_nll  # noqa: E402

START, NEW = 64, 32  # a system prompt kept at the front; the new message


def first_token_s(scheduler: Scheduler, prompt: np.ndarray) -> tuple[float, int, int]:
    """Seconds from submitting `prompt` to its first token, and its cached and moved token counts."""
    got, done = [], []
    scheduler.add(Request(prompt.tolist(), 1, lambda e: (got if isinstance(e, TokenEvent) else done).append(e),
                          SamplingParams(), frozenset()))
    t0 = time.perf_counter()
    while not got:
        scheduler.step()
    seconds = time.perf_counter() - t0
    while scheduler.has_work():
        scheduler.step()
    return seconds, done[0].cached_tokens, done[0].shifted_tokens


def speed(export_dir: Path, context: int, dropped: int, repeats: int) -> dict:
    model = ExportedModel(export_dir)
    kept = context - START - dropped - NEW
    if context > model.max_seq_len or kept < 64:
        raise SystemExit(f"--context {context}: {export_dir} holds {model.max_seq_len} tokens, and --dropped {dropped} "
                         f"must leave at least 64 kept of it")
    rng = np.random.default_rng(0)
    start, gone, held, new = (rng.integers(3, model.config.vocab_size - 1, n) for n in (START, dropped, kept, NEW))
    before, after = np.concatenate([start, gone, held]), np.concatenate([start, held, new])
    times: dict[str, list[float]] = {"moved": [], "prefilled": []}
    counts = {}
    for _ in range(repeats):
        for name, least in (("moved", 64), ("prefilled", 0)):
            scheduler = Scheduler(model, max_batch=1, cache_reuse=least)
            first_token_s(scheduler, before)
            seconds, cached, shifted = first_token_s(scheduler, after)
            times[name].append(seconds)
            counts[name] = {"cached": cached, "moved": shifted, "prefilled": len(after) - cached}
            print(f"  {name}: {seconds:.2f} s to the first token ({counts[name]})", flush=True)
    caches = CacheBuffers(model.config, 1, context, model.max_seq_len, "cpu", model.cache_format)
    move = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        caches.move_slots(0, 0, [Moved(START + dropped, START, kept)])
        move.append(time.perf_counter() - t0)
    moved, prefilled = statistics.median(times["moved"]), statistics.median(times["prefilled"])
    return {"export": str(export_dir), "layers": model.config.num_hidden_layers, "context": context,
            "start": START, "dropped": dropped, "kept": kept, "new": NEW, "tokens": counts,
            "first_token_s": {"moved": moved, "prefilled": prefilled, "runs": times},
            "speedup": prefilled / moved, "move_slots_s": statistics.median(move)}


def prefill(model: ExportedModel, caches: CacheBuffers, ids: np.ndarray, start: int, every: bool) -> np.ndarray:
    """The prefill graph over `caches` (batch 1) from slot and position `start`: logits of every position (or the
    last)."""
    feed = {io_spec.INPUT_IDS: ids[None], io_spec.POSITION_IDS: np.arange(start, start + len(ids))[None],
            io_spec.ATTENTION_MASK: np.ones((1, caches.capacity), np.int64), io_spec.WRITE_INDICES: np.array([start]),
            io_spec.LOGITS_POSITIONS: (np.arange(len(ids)) if every else np.array([len(ids) - 1]))[None],
            **{t.past: caches.arrays[t.past] for t in caches.tensors}}
    logits, *presents = model.sessions[io_spec.PREFILL].run(
        [io_spec.LOGITS] + [t.present for t in caches.tensors], feed)
    for t, present in zip(caches.tensors, presents):
        caches.arrays[t.past][...] = present
    return logits[0]


def quality(export_dir: Path, text: Path, first: int, dropped: int, kept: int, scored: int) -> dict:
    model = ExportedModel(export_dir)
    tokens = np.asarray(Tokenizer.from_export(model.directory, model.manifest).encode(text.read_text()), np.int64)
    span = first + dropped + kept + scored
    if span > model.max_seq_len:
        raise SystemExit(f"{export_dir}: a window of {span} tokens is past its {model.max_seq_len}")
    nll_fresh, nll_moved, nll_whole, agree = [], [], [], []
    for w in range(len(tokens) // span):
        window = tokens[w * span : (w + 1) * span]
        start, gone = window[:first], window[first : first + dropped]
        held, tail = window[first + dropped : first + dropped + kept], window[first + dropped + kept :]
        fresh = CacheBuffers(model.config, 1, span, model.max_seq_len, "cpu", model.cache_format)
        prefill(model, fresh, np.concatenate([start, held]), 0, False)
        exact = prefill(model, fresh, tail, first + kept, True)
        moved = CacheBuffers(model.config, 1, span, model.max_seq_len, "cpu", model.cache_format)
        prefill(model, moved, np.concatenate([start, gone, held]), 0, False)
        moved.move_slots(0, 0, [Moved(first + dropped, first, kept)])
        approx = prefill(model, moved, tail, first + kept, True)
        whole = CacheBuffers(model.config, 1, span, model.max_seq_len, "cpu", model.cache_format)
        prefill(model, whole, window[:-scored], 0, False)
        nll_whole.append(log_softmax_nll(prefill(model, whole, tail, span - scored, True)[:-1], tail[1:]))
        nll_fresh.append(log_softmax_nll(exact[:-1], tail[1:]))
        nll_moved.append(log_softmax_nll(approx[:-1], tail[1:]))
        agree.append(exact[:-1].argmax(-1) == approx[:-1].argmax(-1))
    fresh_nll, moved_nll, whole_nll = (np.concatenate(n) for n in (nll_fresh, nll_moved, nll_whole))
    return {"export": str(export_dir), "text": str(text), "windows": len(nll_fresh), "start": first,
            "dropped": dropped, "kept": kept, "scored": scored, "fresh_nll": float(fresh_nll.mean()),
            "moved_nll": float(moved_nll.mean()), "whole_nll": float(whole_nll.mean()),
            "perplexity_ratio": float(np.exp(moved_nll.mean() - fresh_nll.mean())),
            "whole_perplexity_ratio": float(np.exp(whole_nll.mean() - fresh_nll.mean())),
            "top1_agreement": float(np.concatenate(agree).mean())}


def demo_export() -> Path:
    from mla_deploy.export import export

    out = ROOT / "benchmarks/work/cache_reuse/demo"
    if not (out / "manifest.json").exists():
        export(DEMO_CHECKPOINT, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speed", type=Path, default=None, help="An export to time (default: the demo model).")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--dropped", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quality", type=Path, default=None, help="An export to score (default: the demo model).")
    ap.add_argument("--text", type=Path, default=DEMO_CHECKPOINT / "heldout.txt")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cache_reuse.json")
    args = ap.parse_args()
    import onnxruntime

    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine_info(0), "onnxruntime": onnxruntime.__version__}
    quality_dir = args.quality or demo_export()
    print(f"quality, {quality_dir}:", flush=True)
    # windows of 256 tokens, the demo model's training length: its later positions are untrained
    result["quality"] = [quality(quality_dir, args.text, *sizes) for sizes in ((16, 48, 128, 64), (16, 112, 96, 32))]
    for q in result["quality"]:
        print(f"  dropped {q['dropped']}, kept {q['kept']}, {q['windows']} windows: perplexity x"
              f"{q['perplexity_ratio']:.4f}, top-1 agreement {q['top1_agreement']:.3f} (never dropped: perplexity x"
              f"{q['whole_perplexity_ratio']:.4f})", flush=True)
    speed_dir = args.speed or quality_dir
    print(f"speed, {speed_dir}, context {args.context}, {args.dropped} dropped:", flush=True)
    s = result["speed"] = speed(speed_dir, args.context, args.dropped, args.repeats)
    print(f"  first token: moved {s['first_token_s']['moved']:.3f} s, prefilled again "
          f"{s['first_token_s']['prefilled']:.3f} s ({s['speedup']:.1f}x); the move alone {s['move_slots_s']:.3f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
