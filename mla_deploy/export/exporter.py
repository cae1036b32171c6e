"""Checkpoint -> export directory: prefill.onnx, decode.onnx, one shared weights file, manifest, tokenizer.

Everything is written to a temporary sibling directory, checked (onnx.checker full check, and the
verifier unless skipped), fsynced, then renamed into place: a failed export leaves nothing behind.
Weights stream: each is read from the checkpoint, transformed, appended to `weights.bin` and dropped
while the graphs are built (export.weights), so memory follows the largest tensor, not the model.
Both graphs refer to that one file as external data: the tensors they share are stored once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import onnx
import onnx_ir as ir

from .. import __version__, integrity, io_spec
from ..checkpoint import Checkpoint
from ..errors import ExportError
from ..manifest import MANIFEST_FILE, MANIFEST_VERSION, TOKENIZER_FILES, WEIGHTS_FILE, file_sha256
from .absorb import AbsorbMode, absorbed_weight_bytes, resolve_absorb
from .decode_attention import resolve_decode_attention
from .experts import resolve_experts
from ..progress import progress_bar
from .graphs import build_graph, op_counts
from . import layers
from .opset import OPSET
from .precision import Precision, RoundedCheckpoint
from .quantize import Quantization, quantized_hf_names
from .weights import WeightsFile

Progress = Callable[[str], None]


QUANTIZE_BITS = {"int4": 4, "int8": 8}


@dataclass
class ExportOptions:
    absorb: str = "auto"
    dtype: str = "float32"
    max_seq_len: int | None = None  # default: the config's max_position_embeddings
    force: bool = False
    quantize: str | None = None  # "int4" or "int8": weight-only, block-wise (export.quantize)
    block_size: int = 32
    accuracy_level: int = 4  # MatMulNBits: 4 = int8 activations inside the kernel, 0 = float (exact)
    head_bits: int = 8  # the embedding and the output layer of a quantized export: 8, or 4 (smallest, fastest)
    experts: str = "auto"  # routed experts: auto, qmoe (quantized), kernel, moe, dense (float), branches (export.experts)
    decode_attention: str = "auto"  # the decode graph's attention core: auto, kernel, ops (export.decode_attention)

    def quantization(self) -> Quantization | None:
        if self.quantize is None:
            if self.head_bits != 8:
                raise ExportError(f"--head-bits {self.head_bits}: the embedding and output layer keep the export's "
                                  f"--dtype unless it is quantized (add --quantize int4 or int8)")
            return None
        if self.quantize not in QUANTIZE_BITS:
            raise ExportError(f"--quantize {self.quantize}: expected one of {', '.join(QUANTIZE_BITS)}")
        if self.head_bits not in QUANTIZE_BITS.values():
            raise ExportError(f"--head-bits {self.head_bits}: expected one of {', '.join(map(str, QUANTIZE_BITS.values()))}")
        try:
            return Quantization(QUANTIZE_BITS[self.quantize], self.block_size, self.accuracy_level, self.head_bits)
        except ValueError as e:
            raise ExportError(f"--quantize {self.quantize}: {e}") from None


@dataclass
class ExportResult:
    directory: Path
    absorb: AbsorbMode
    manifest: dict
    notes: list[str] = field(default_factory=list)


def export(checkpoint_dir: str | Path, out_dir: str | Path, options: ExportOptions = ExportOptions(),
           progress: Progress = lambda msg: None, verify: Callable[[Path], None] | None = None) -> ExportResult:
    """Export a checkpoint; `verify(tmp_dir)` (raising on failure) runs before the directory is moved into place."""
    out = Path(out_dir)
    try:
        precision = Precision(options.dtype)
    except ValueError as e:
        raise ExportError(f"--dtype {options.dtype}: {e}") from None
    if out.exists() and not options.force:
        raise ExportError(f"{out}: output directory exists (use --force to replace it)")
    progress(f"loading checkpoint {checkpoint_dir}")
    ckpt = Checkpoint(checkpoint_dir)
    cfg = ckpt.config
    for note in ckpt.notes:
        progress(f"note: {note}")
    max_seq_len = options.max_seq_len or cfg.max_position_embeddings
    if not 1 <= max_seq_len <= cfg.max_position_embeddings:
        raise ExportError(f"--max-seq-len {max_seq_len}: must be between 1 and max_position_embeddings={cfg.max_position_embeddings}")
    mode = resolve_absorb(cfg, options.absorb)
    quantization = options.quantization()
    if AbsorbMode(options.absorb) == AbsorbMode.AUTO:
        fused, factored = (absorbed_weight_bytes(cfg, m) / 1e6 for m in (AbsorbMode.FUSED, AbsorbMode.FACTORED))
        progress(f"absorb auto -> {mode.value}: attention weights read per decode token and layer, computed from the "
                 f"config: factored {factored:.2f} MB, fused {fused:.2f} MB (bytes decide, not a timing)")

    source = RoundedCheckpoint(ckpt, precision.dtype)  # the weights as the export's dtype holds them
    experts = resolve_experts(cfg, options.experts, quantization)
    if cfg.n_routed_experts:
        progress(f"routed experts: {experts} ({options.experts})")
    decode_attention = resolve_decode_attention(cfg, options.decode_attention, precision.dtype)
    progress(f"decode attention: {decode_attention} ({options.decode_attention})")
    progress("hashing source weights")
    source_hash = ckpt.content_hash()
    recipe = (f"{source_hash}|{mode.value}|{options.dtype}|{max_seq_len}|{quantization}|{experts}|{decode_attention}|"
              f"{__version__}")
    export_id = hashlib.sha256(recipe.encode()).hexdigest()[:32]
    metadata = {"producer": "mla-deploy", "mla_deploy_version": __version__, "export_id": export_id}

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        graphs = {}
        with WeightsFile(tmp / WEIGHTS_FILE) as weights:
            for kind in (io_spec.PREFILL, io_spec.DECODE):
                progress(f"building {kind} graph" + (f" (absorbed, {mode.value})" if kind == io_spec.DECODE
                                                     else " (naive attention)") + ", writing its weights")
                with progress_bar(cfg.num_hidden_layers, f"{kind} layers", "layer") as advance:
                    graphs[kind] = build_graph(kind, cfg, source.tensor, max_seq_len, mode, weights, metadata,
                                               on_layer=lambda i: advance(1), quantization=quantization,
                                               experts=experts, precision=precision,
                                               decode_attention=decode_attention)
        progress(f"wrote weights ({weights.nbytes / 1e9:.2f} GB)")
        manifest = _manifest(cfg, mode, options, max_seq_len, source_hash, export_id, ckpt)
        manifest["experts"] = experts if cfg.n_routed_experts else None
        manifest["decode_attention"] = decode_attention
        manifest["precision"] = {"dtype": precision.dtype, "compute": precision.compute, "caches": precision.dtype,
                                 "float32": "norm weights, rope tables, routers, per-head W^UK / W^UV, fused absorbed "
                                            "matrices (the math around them runs in float32 too)"}
        manifest["quantization"] = None if quantization is None else {
            **quantization.to_dict(), "quantized_weights": len(quantized_hf_names(cfg)),
            "float": "kv_b_proj, routers, norms, rope tables" + (", per-head W^UK / W^UV" if mode == AbsorbMode.FACTORED else ""),
            **({"absorbed": "fused W^Q·W^UK and W^UV·W^O quantized after absorption"} if mode == AbsorbMode.FUSED else {})}
        manifest["weights"].update(bytes=weights.nbytes, block_bytes=integrity.BLOCK_BYTES,
                                   digest=integrity.DIGEST, block_digests=integrity.block_digests(tmp / WEIGHTS_FILE))
        for kind, model in graphs.items():
            progress(f"saving and checking {kind}.onnx")
            path = tmp / io_spec.GRAPH_FILES[kind]
            ir.save(model, path)  # external tensors stay references into weights.bin
            onnx.checker.check_model(str(path), full_check=True)
            manifest["graphs"][kind]["sha256"] = file_sha256(path)
            manifest["graphs"][kind]["op_counts"] = op_counts(model)
        manifest["tokenizer"] = _copy_tokenizer(ckpt.directory, tmp)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if verify is not None:
            progress("verifying against the torch source")
            verify(tmp)
        _fsync_tree(tmp)
        _move_into_place(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise ExportError(f"{out}: writing the export failed ({e.strerror or e}); nothing was left behind") from None
        raise
    progress(f"wrote {out}")
    return ExportResult(out, mode, manifest, list(ckpt.notes))


def _manifest(cfg, mode, options, max_seq_len, source_hash, export_id, ckpt) -> dict:
    graphs = {}
    for kind in (io_spec.PREFILL, io_spec.DECODE):
        inputs, outputs = io_spec.graph_io(kind, cfg.num_hidden_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.vocab_size,
                                           cache_dtype=options.dtype)
        graphs[kind] = {"file": io_spec.GRAPH_FILES[kind], "inputs": [s.to_dict() for s in inputs],
                        "outputs": [s.to_dict() for s in outputs]}
    return {
        "format": "mla-deploy-export", "manifest_version": MANIFEST_VERSION, "mla_deploy_version": __version__,
        "export_id": export_id, "config": cfg.to_dict(), "absorb": mode.value, "dtype": options.dtype, "opset": OPSET,
        "max_seq_len": max_seq_len, "source": {"path": str(ckpt.directory.resolve()), "sha256": source_hash},
        "weights": {"file": WEIGHTS_FILE}, "graphs": graphs,
    }


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def _fsync_tree(directory: Path) -> None:
    for p in directory.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def _move_into_place(tmp: Path, out: Path) -> None:
    if out.exists():  # --force: swap, then remove the old export
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
