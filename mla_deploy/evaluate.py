"""Loss and perplexity of a text through the exported graphs and through the torch source, side by side."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .checkpoint import Checkpoint
from .errors import ExportError, InputError
from .manifest import is_staged, read_manifest, require_whole
from .modeling import AttentionForm, load_model, new_caches
from .runtime import ExportedModel, Tokenizer
from .runtime.scoring import export_scores, log_softmax_nll, windows


@dataclass
class EvalReport:
    tokens: int
    windows: int
    export_loss: float
    torch_loss: float
    top1_agreement: float  # fraction of positions where the export's most likely next token is the source's
    quantization: dict | None = None  # the export's; then the difference is its quality cost, not an error
    dtype: str = "float32"  # the export's; half precision too is a quality cost
    caches: tuple[str, str] = ("float32", "float32")  # the latent's and the roped key's: a narrower one too

    TOLERANCE = 1e-4  # |Δ loss| a float32 export may differ from its source by

    @property
    def lossy(self) -> bool:
        """Quantized, half precision or a narrower cache: measured against the float source, not held to
        TOLERANCE."""
        return self.quantization is not None or self.dtype != "float32" or self.caches != ("float32", "float32")

    @property
    def difference(self) -> float:
        return abs(self.export_loss - self.torch_loss)

    @property
    def passed(self) -> bool:
        """A finite loss, and for a float32 export within TOLERANCE of the source's."""
        return math.isfinite(self.export_loss) and (self.lossy or self.difference <= self.TOLERANCE)

    def lines(self) -> list[str]:
        lines = [
            f"scored {self.tokens} tokens in {self.windows} windows",
            f"onnx export : loss {self.export_loss:.4f}  perplexity {math.exp(self.export_loss):.3f}",
            f"torch source: loss {self.torch_loss:.4f}  perplexity {math.exp(self.torch_loss):.3f}",
            f"|Δ loss| {self.difference:.2e}",
            f"top-1 agreement with the torch source: {self.top1_agreement:.2%} of {self.tokens} positions",
        ]
        cost = self.export_loss - self.torch_loss
        cost = f"loss {cost:+.4f} nats/token, perplexity x{math.exp(cost):.4f}"
        if self.dtype != "float32":
            lines.append(f"{self.dtype} against the float32 source: {cost}")
        if self.caches != ("float32", "float32"):
            latent, rope = self.caches
            lines.append(f"{latent} latent and {rope} rope caches against float32 ones: {cost}")
        if self.quantization is not None:
            q = self.quantization
            lines.append(f"quantized int{q['bits']}, block {q['block']}, accuracy_level {q['accuracy_level']} "
                         f"against the float source: {cost}")
        return lines

    def to_dict(self) -> dict:
        """The report as `eval --json` prints it: both losses and perplexities, their difference, top-1 agreement,
        what the export is (dtype, quantization, caches) and whether it passed."""
        return {"tokens": self.tokens, "windows": self.windows,
                "export": {"loss": self.export_loss, "perplexity": _exp(self.export_loss)},
                "torch": {"loss": self.torch_loss, "perplexity": _exp(self.torch_loss)},
                "loss_difference": self.export_loss - self.torch_loss, "top1_agreement": self.top1_agreement,
                "dtype": self.dtype, "quantization": self.quantization,
                "caches": {"latent": self.caches[0], "rope": self.caches[1]},
                "lossy": self.lossy, "passed": self.passed, "tolerance": None if self.lossy else self.TOLERANCE}


def _exp(loss: float) -> float | None:
    """exp(loss) as JSON carries it: None where it overflows or the loss is not finite."""
    try:
        value = math.exp(loss)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _read_text(path: str | Path) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a leading byte-order mark is not text
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); eval "
                         "scores text files") from None
    if not text.strip():
        raise InputError(f"{path}: empty; eval needs text to score")
    return text


def read_token_ids(path: str | Path, vocab_size: int) -> list[int]:
    """Token ids separated by whitespace or commas, each in [0, vocab_size)."""
    try:
        words = Path(path).read_text(encoding="ascii").replace(",", " ").split()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a token-id file (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                         "expected integers separated by whitespace or commas") from None
    ids = []
    for n, word in enumerate(words, 1):
        try:
            ids.append(int(word))
        except ValueError:
            raise InputError(f"{path}: token {n} is {word[:20]!r}, not an integer; expected integers separated by "
                             "whitespace or commas") from None
        if not 0 <= ids[-1] < vocab_size:
            raise InputError(f"{path}: token {n} is {ids[-1]}, outside the vocabulary [0, {vocab_size})")
    if not ids:
        raise InputError(f"{path}: empty; eval needs token ids to score")
    return ids


class _Progress:
    """'<what>: windows done/total, tokens/s' lines, at most one every few seconds (and at the end)."""

    def __init__(self, progress: Callable[[str], None], what: str, total: int, window: int, every_s: float = 5.0):
        self.progress, self.what, self.total, self.window, self.every_s = progress, what, total, window, every_s
        self.start = self.last = time.perf_counter()

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if done < self.total and now - self.last < self.every_s:
            return
        self.last = now
        rate = done * self.window / max(now - self.start, 1e-9)
        self.progress(f"{self.what}: {done}/{self.total} windows, {rate:.0f} tokens/s")


def evaluate(
    export_dir: str | Path,
    text_file: str | Path | None = None,
    window: int = 256,
    checkpoint_dir: str | Path | None = None,
    progress: Callable[[str], None] = lambda msg: None,
    ids_file: str | Path | None = None,
) -> EvalReport:
    """Score `text_file` (UTF-8 text, through the export's tokenizer) or `ids_file` (token ids separated by
    whitespace or commas: an export without a tokenizer) in windows of `window` tokens."""
    if (text_file is None) == (ids_file is None):
        raise InputError("give one of a text file or a token-id file to score" + (", not both" if text_file else ""))
    manifest = read_manifest(export_dir)
    require_whole(export_dir, manifest, "eval")
    if is_staged(manifest):
        raise InputError(f"{export_dir}: a staged export; eval scores a whole export in this process: export the "
                         "checkpoint without --stages to score it (its stages compute the same model)")
    model = ExportedModel(export_dir)
    if isinstance(window, int) and not isinstance(window, bool) and window > model.max_seq_len:
        raise InputError(f"window {window} exceeds the export's maximum length {model.max_seq_len}: score in windows "
                         f"of at most {model.max_seq_len} tokens")
    if ids_file is not None:
        ids = read_token_ids(ids_file, model.config.vocab_size)
    else:
        tokenizer = Tokenizer.from_export(export_dir, model.manifest)
        if tokenizer is None:
            raise InputError(f"{export_dir}: export has no tokenizer to read text: give the text as token ids "
                             "(--ids FILE)")
        ids = tokenizer.encode(_read_text(text_file))
    source = Path(checkpoint_dir or model.manifest["source"]["path"])
    ckpt = Checkpoint(source)  # the source checked before any scoring, as verify checks it
    if ckpt.content_hash() != model.manifest["source"]["sha256"]:
        raise ExportError(f"{source}: checkpoint differs from the one {export_dir} was exported from (sha256 mismatch)")
    batch = windows(ids, window)
    export_nll, export_top1 = export_scores(
        model, batch, on_run=_Progress(progress, "onnx export ", len(batch), window)
    )
    torch_model = load_model(ckpt)
    nll, top1 = [], []
    torch_progress = _Progress(progress, "torch source", len(batch), window)
    for done, w in enumerate(batch, 1):
        t = len(w) - 1
        ids = torch.from_numpy(w[None, :-1])
        logits = torch_model(ids, torch.arange(t)[None], new_caches(torch_model.cfg, 1, t),
                             torch.zeros(1, dtype=torch.long), torch.ones(1, t), form=AttentionForm.NAIVE)
        nll.append(log_softmax_nll(logits.numpy()[0], w[1:]))
        top1.append(logits.numpy()[0].argmax(-1))
        torch_progress(done)
    agreement = float((export_top1 == np.concatenate(top1)).mean())
    return EvalReport(len(export_nll), len(batch), float(export_nll.mean()), float(np.concatenate(nll).mean()),
                      agreement, model.manifest.get("quantization"), model.manifest["dtype"],
                      (model.cache_format.latent, model.cache_format.rope))
