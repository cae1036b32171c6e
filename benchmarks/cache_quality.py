"""What an int8 latent cache costs in quality, measured on text: the same checkpoint exported with its float cache and
with --cache-dtype int8, scored on the same held-out text two ways.

  prefill: every window through the prefill graph (runtime.scoring, what `mla-deploy eval` does), whose attention
           over the int8 cache runs in mla_deploy.LatentAttentionChunkQ8 (int8 queries, the cache just written);
  decode:  every window teacher-forced through the decode graph one token at a time (windows as the rows of one
           batch), where the int8 export's attention runs in mla_deploy.LatentAttentionQ8 (int8 queries) or, with the
           kernel library off, in its function body (the exact dequantized form).

Reported against the float-cache export on the same path: perplexity ratio exp(mean NLL difference) and top-1
agreement (the share of positions whose most likely next token is the same). Results: a JSON file.

--formats compares candidate int8 formats instead, on the torch source (naive prefill over its cache, entries
rounded as written): the latent with one scale per token or per group of 32 or 16 channels, the roped key in float32
or int8 (one scale per token, or per group of 8), each against the unrounded cache. These figures chose the format
export --cache-dtype int8 writes (export.plan).

    .venv/bin/python benchmarks/cache_quality.py [--checkpoint DIR (default: the demo model)] [--text FILE]
        [--window 256] [--workdir benchmarks/work/cache_quality] [--out benchmarks/results/cache_quality.json]
        [--formats]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mla_deploy import io_spec  # noqa: E402
from mla_deploy.export import ExportOptions, export  # noqa: E402
from mla_deploy.presets import DEMO_CHECKPOINT  # noqa: E402
from mla_deploy.runtime import ExportedModel, RuntimeOptions, Tokenizer  # noqa: E402
from mla_deploy.runtime.cache import CacheBuffers, DecodeBinding  # noqa: E402
from mla_deploy.runtime.scoring import export_scores, log_softmax_nll, windows  # noqa: E402


def decode_scores(model: ExportedModel, batch: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """NLL and top-1 prediction of every next token, each window a row, fed one token a step through the decode graph
    (the windows of one length only: the last, shorter window is left out by the caller)."""
    rows, length = len(batch), len(batch[0])
    caches = CacheBuffers(model.config, rows, length, model.max_seq_len, "cpu", model.cache_format)
    d = DecodeBinding(model.sessions[io_spec.DECODE], caches, rows, model.config.vocab_size)
    ids = np.stack(batch)  # [rows, length]
    nll, top1 = np.zeros((rows, length - 1)), np.zeros((rows, length - 1), np.int64)
    for p in range(length - 1):
        d.ids[:, 0], d.pos[:, 0], d.write[:] = ids[:, p], p, p
        model.sessions[io_spec.DECODE].run_with_iobinding(d.binding)
        nll[:, p] = log_softmax_nll(d.logits[:, 0], ids[:, p + 1])
        top1[:, p] = d.logits[:, 0].argmax(-1)
    return nll.reshape(-1), top1.reshape(-1)


def compare(name: str, nll: np.ndarray, top1: np.ndarray, ref_nll: np.ndarray, ref_top1: np.ndarray) -> dict:
    ratio = math.exp(float(nll.mean() - ref_nll.mean()))
    agreement = float((top1 == ref_top1).mean())
    print(f"  {name:<44} loss {nll.mean():.5f}  perplexity ratio {ratio:.5f}  top-1 agreement {agreement:.4%}")
    return {"loss": float(nll.mean()), "perplexity_ratio": ratio, "top1_agreement": agreement, "positions": len(nll)}


def int8_rounded(x, group: int):
    """x [..., width] as int8 codes with a scale per `group` channels (io_spec's rule per group), times the scale."""
    import torch

    from mla_deploy.modeling.cache import FLT_MIN

    g = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = torch.clamp(g.abs().amax(-1, keepdim=True) / 127, min=FLT_MIN)
    return (torch.clamp(torch.round(g / scale), -127, 127) * scale).reshape(x.shape)


def formats(args, batch: list[np.ndarray]) -> dict:
    """The torch source's prefill over caches rounded per candidate format, against unrounded caches."""
    import torch

    from mla_deploy.modeling import AttentionForm, LayerCache, load_model

    class Rounded(LayerCache):
        def __init__(self, latent, rope, latent_group, rope_group):
            super().__init__(latent, rope)
            self.latent_group, self.rope_group = latent_group, rope_group

        def write(self, latent, rope, write_indices):
            latent = latent if self.latent_group is None else int8_rounded(latent, self.latent_group)
            rope = rope if self.rope_group is None else int8_rounded(rope, self.rope_group)
            super().write(latent, rope, write_indices)

    model = load_model(args.checkpoint)
    cfg = model.cfg

    def scores(latent_group, rope_group):
        nll, top1 = [], []
        for w in batch:
            t = len(w) - 1
            caches = [
                Rounded(
                    torch.zeros(1, t, cfg.kv_lora_rank),
                    torch.zeros(1, t, cfg.qk_rope_head_dim),
                    latent_group,
                    rope_group,
                )
                for _ in range(cfg.num_hidden_layers)
            ]
            logits = model(
                torch.from_numpy(w[None, :-1]),
                torch.arange(t)[None],
                caches,
                torch.zeros(1, dtype=torch.long),
                torch.ones(1, t),
                form=AttentionForm.NAIVE,
            ).numpy()[0]
            nll.append(log_softmax_nll(logits, w[1:]))
            top1.append(logits.argmax(-1))
        return np.concatenate(nll), np.concatenate(top1)

    dc, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    ref = scores(None, None)
    print(f"torch source, naive prefill, {len(batch)} windows of {args.window}, against unrounded caches:")
    out = {}
    for latent_group, rope_group in ((dc, None), (32, None), (16, None), (dc, dr), (dc, 8), (16, 8)):
        name = f"latent: a scale per {'token' if latent_group == dc else f'{latent_group} channels'}; rope: " + (
            "float32"
            if rope_group is None
            else f"int8, a scale per {'token' if rope_group == dr else f'{rope_group} channels'}"
        )
        out[name] = compare(name, *scores(latent_group, rope_group), *ref)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, default=DEMO_CHECKPOINT)
    ap.add_argument("--text", type=Path, default=DEMO_CHECKPOINT / "heldout.txt")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / "work" / "cache_quality")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cache_quality.json")
    ap.add_argument("--formats", action="store_true", help="compare candidate int8 formats on the torch source")
    args = ap.parse_args()
    if args.formats:
        tokenizer = Tokenizer(args.checkpoint / "tokenizer.json")
        batch = windows(tokenizer.encode(args.text.read_text()), args.window)
        results = {"date": time.strftime("%Y-%m-%d"), "checkpoint": str(args.checkpoint), "text": str(args.text),
                   "window": args.window, "formats": formats(args, batch)}
        path = args.out.with_name(args.out.stem + "_formats.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {path}")
        return 0
    exports = {}
    for cache in ("auto", "int8"):
        exports[cache] = args.workdir / f"export-{cache}"
        if not (exports[cache] / "manifest.json").exists():
            export(args.checkpoint, exports[cache], ExportOptions(cache_dtype=cache, force=True))
    float_model = ExportedModel(exports["auto"])
    tokenizer = Tokenizer.from_export(exports["auto"], float_model.manifest)
    batch = windows(tokenizer.encode(args.text.read_text()), args.window)
    full = [w for w in batch if len(w) == args.window + 1]  # decode: the windows of one length
    results = {"date": time.strftime("%Y-%m-%d"), "checkpoint": str(args.checkpoint), "text": str(args.text),
               "window": args.window, "windows": len(batch)}

    print(f"prefill graph, {len(batch)} windows of {args.window}:")
    ref = export_scores(float_model, batch)
    int8 = export_scores(ExportedModel(exports["int8"]), batch)
    results["prefill"] = compare("int8 cache vs float cache", *int8, *ref)

    print(f"decode graph, teacher-forced, {len(full)} windows of {args.window} as one batch:")
    ref = decode_scores(float_model, full)
    results["decode"] = {
        "kernel": compare(
            "int8 cache, LatentAttentionQ8 vs float cache", *decode_scores(ExportedModel(exports["int8"]), full), *ref
        ),
        "function_body": compare(
            "int8 cache, function body vs float cache",
            *decode_scores(ExportedModel(exports["int8"], RuntimeOptions(kernels=False)), full),
            *ref,
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
