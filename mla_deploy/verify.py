"""Verify an export against its torch source: prefill logits, N decode steps, and generated tokens.

The same batch (rows of different lengths) goes through the torch model and through the graphs.
Decode steps are teacher-forced with the torch model's greedy tokens, so every step compares the
same inputs. Then the runtime's own Generator (in-place caches, chunked prefill) must produce the
torch model's greedy tokens. Tolerance: max |Δlogit| <= rtol · max(1, max |logit|).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from . import io_spec
from .checkpoint import Checkpoint
from .errors import ExportError
from .modeling import AttentionForm, load_model, new_caches
from .runtime import ExportedModel, Generator, RuntimeOptions
from .runtime.feeds import prefill_feed

DEFAULT_RTOL = 1e-4


@dataclass
class VerifyReport:
    prefill_max_abs: float
    decode_max_abs: list[float]
    token_agreement: float  # fraction of runtime-generated tokens equal to the torch source's greedy tokens
    logit_scale: float
    rtol: float
    lines: list[str] = field(default_factory=list)

    @property
    def tolerance(self) -> float:
        return self.rtol * max(1.0, self.logit_scale)

    @property
    def passed(self) -> bool:
        worst = max([self.prefill_max_abs, *self.decode_max_abs])
        return worst <= self.tolerance and self.token_agreement == 1.0


def verify_export(export_dir: str | Path, checkpoint_dir: str | Path | None = None, steps: int = 8,
                  rtol: float = DEFAULT_RTOL, lengths: tuple[int, ...] = (13, 7, 3), seed: int = 0) -> VerifyReport:
    model = ExportedModel(export_dir, RuntimeOptions())
    manifest = model.manifest
    source = Path(checkpoint_dir or manifest["source"].get("path", ""))
    ckpt = Checkpoint(source)
    if ckpt.content_hash() != manifest["source"]["sha256"]:
        raise ExportError(f"{source}: checkpoint differs from the one {export_dir} was exported from (sha256 mismatch)")
    torch_model = load_model(ckpt)
    cfg = torch_model.cfg
    lengths = tuple(min(n, model.max_seq_len - steps - 1) for n in lengths)
    if min(lengths) < 1:
        raise ExportError(f"--steps {steps}: too many for the export's maximum length {model.max_seq_len}")
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    b, longest, capacity = len(rows), max(lengths), max(lengths) + steps
    ids = np.zeros((b, longest), np.int64)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row
    lens = np.array(lengths, np.int64)

    # prefill: every position's logits, right-padded rows
    feed = prefill_feed(cfg, ids, capacity)
    caches = new_caches(cfg, b, capacity)
    mask = feed[io_spec.ATTENTION_MASK]
    ref = torch_model(torch.from_numpy(ids), torch.from_numpy(feed[io_spec.POSITION_IDS]), caches,
                      torch.zeros(b, dtype=torch.long), torch.from_numpy(mask), form=AttentionForm.NAIVE).numpy()
    out = model.run(io_spec.PREFILL, feed)
    valid = np.arange(longest)[None, :] < lens[:, None]
    prefill_diff = float(np.abs(out[io_spec.LOGITS] - ref)[valid].max())
    scale = float(np.abs(ref[valid]).max())
    report = VerifyReport(prefill_diff, [], 0.0, scale, rtol)
    report.lines.append(f"prefill  batch {b}, lengths {list(lengths)}: max |Δlogit| {prefill_diff:.3e}")

    # decode: teacher-forced with the torch model's greedy tokens
    last = ref[np.arange(b), lens - 1]  # [b, vocab]
    greedy = [[] for _ in range(b)]
    cache_feed = {k: v for k, v in out.items() if k != io_spec.LOGITS}
    for step in range(steps):
        token = last.argmax(-1)
        for r in range(b):
            greedy[r].append(int(token[r]))
        slot = lens + step
        ref_step = torch_model(torch.from_numpy(token[:, None]), torch.from_numpy(slot[:, None]), caches,
                               torch.from_numpy(slot), torch.from_numpy(mask), form=AttentionForm.ABSORBED).numpy()[:, 0]
        feed = {io_spec.INPUT_IDS: token[:, None].astype(np.int64), io_spec.POSITION_IDS: slot[:, None],
                io_spec.ATTENTION_MASK: mask, io_spec.WRITE_INDICES: slot}
        feed.update({k.replace("present", "past"): v for k, v in cache_feed.items()})
        out = model.run(io_spec.DECODE, feed)
        cache_feed = {k: v for k, v in out.items() if k != io_spec.LOGITS}
        diff = float(np.abs(out[io_spec.LOGITS][:, 0] - ref_step).max())
        report.decode_max_abs.append(diff)
        report.logit_scale = max(report.logit_scale, float(np.abs(ref_step).max()))
        report.lines.append(f"decode   step {step + 1:>3}: max |Δlogit| {diff:.3e}")
        last = ref_step

    # the runtime end to end: in-place caches, chunked prefill, greedy sampling
    result = Generator(model, chunk_size=max(1, longest // 2), stop_token_ids=()).generate(rows, steps)
    agree = sum(a == c for ours, theirs in zip(result.token_ids, greedy) for a, c in zip(ours, theirs))
    report.token_agreement = agree / (b * steps)
    report.lines.append(f"tokens   runtime greedy vs torch greedy: {agree}/{b * steps} agree")
    report.lines.append(f"{'PASS' if report.passed else 'FAIL'}: tolerance {report.tolerance:.3e} "
                        f"(rtol {rtol:g} x logit scale {max(1.0, report.logit_scale):.2f})")
    return report

