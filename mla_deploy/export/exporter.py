"""Checkpoint -> export directory: prefill.onnx, decode.onnx, verify.onnx (and draft.onnx from a checkpoint with an
MTP layer), one shared weights file, manifest, tokenizer; or, staged (--stages N), one directory per stage (stage-0,
stage-1, ..., each with its prefill and decode graphs, weights and manifest) under a manifest that orders them,
beside the tokenizer.

Everything is written to a temporary sibling directory, checked (onnx.checker full check, and the
verifier unless skipped), fsynced, then renamed into place: a failed export leaves nothing behind.
Weights stream: each is read from the checkpoint, transformed, appended to `weights.bin` and dropped
while the graphs are built (export.weights), so memory follows the largest tensor, not the model.
Every graph refers to that one file as external data: the tensors they share are stored once.
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
from ..checkpoint import Checkpoint, CheckpointView
from ..errors import CheckpointError, ExportError, ExportLoadError
from ..manifest import MANIFEST_FILE, MANIFEST_VERSION, TOKENIZER_FILES, WEIGHTS_FILE, file_sha256, not_an_export
from ..partial import (destination, empty_directory, move_into_place, partial_directory, unreplaceable,
                       unwritable_parent)
from ..progress import progress_bar
from ..runtime.chat import GenerationDefaults, tokenizer_config
from ..runtime.text import Tokenizer
from .absorb import AbsorbMode, absorbed_weight_bytes
from .graphs import build_graph, op_counts
from .opset import OPSET
from .plan import ExportOptions, ExportPlan
from .precision import RoundedCheckpoint
from .quantize import PerHeadRounded
from .weights import WeightsFile

Progress = Callable[[str], None]


@dataclass
class ExportResult:
    directory: Path
    plan: ExportPlan
    manifest: dict
    notes: list[str] = field(default_factory=list)


def export(checkpoint_dir: str | Path, out_dir: str | Path, options: ExportOptions = ExportOptions(),
           progress: Progress = lambda msg: None, verify: Callable[[Path], None] | None = None) -> ExportResult:
    """Export a checkpoint; `verify(tmp_dir)` (raising on failure) runs before the directory is moved into place."""
    out = destination(out_dir)
    options.check()
    _check_output(out, options.force)
    progress(f"loading checkpoint {checkpoint_dir}")
    ckpt = Checkpoint(checkpoint_dir)
    cfg = ckpt.config
    notes = [*ckpt.notes, *_check_copied_configs(ckpt.directory)]
    for note in notes:
        progress(f"note: {note}")
    plan = ExportPlan.resolve(cfg, options, ckpt.has_mtp)
    _report_choices(cfg, options, plan, progress)
    source = RoundedCheckpoint(ckpt, plan.dtype)  # the weights as the export's dtype holds them
    if plan.quantization is not None and plan.quantization.per_head_bits:  # kv_b as its per-head codes hold it
        source = PerHeadRounded(source, plan.quantization)
    progress("hashing source weights")
    source_hash = ckpt.content_hash()
    export_id = hashlib.sha256(plan.recipe(source_hash, __version__).encode()).hexdigest()[:32]

    tmp = partial_directory(out, progress, ExportError)
    try:
        if plan.stages:
            manifest = _top_manifest(cfg, plan, source_hash, export_id, ckpt)
            for stage in plan.stages:
                directory = tmp / manifest["stages"][stage.index]["directory"]
                directory.mkdir()
                stage_id = hashlib.sha256(f"{export_id}|stage {stage.index}".encode()).hexdigest()[:32]
                progress(f"stage {stage.index + 1} of {len(plan.stages)}: layers {stage.first_layer}-"
                         f"{stage.end_layer - 1}" + (", the embedding" if stage.first else "")
                         + (", the final norm and head" if stage.last else ""))
                written = _write_graphs(directory, cfg, plan, source, progress,
                                        _manifest(cfg, plan, source_hash, stage_id, ckpt, stage, export_id), stage)
                manifest["stages"][stage.index].update(export_id=stage_id, weights_bytes=written["weights"]["bytes"])
        else:
            manifest = _write_graphs(tmp, cfg, plan, source, progress,
                                     _manifest(cfg, plan, source_hash, export_id, ckpt))
        manifest["tokenizer"] = _copy_tokenizer(ckpt.directory, tmp)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if verify is not None:
            progress("verifying against the torch source")
            verify(tmp)
        _fsync_tree(tmp)
        _move_into_place(tmp, out, options.force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise ExportError(
                f"{out}: writing the export failed ({e.strerror or e}); nothing was left behind"
            ) from None
        raise
    progress(f"wrote {out}")
    return ExportResult(out, plan, manifest, notes)


def _write_graphs(directory: Path, cfg, plan: ExportPlan, source: CheckpointView,
                  progress: Progress, manifest: dict, stage: io_spec.Stage | None = None) -> dict:
    """The graphs (of one stage) and their one weights file into `directory`; returns `manifest` completed with the
    weights' digests and the graphs' hashes and operator counts."""
    graphs, layers = {}, len(stage.layers) if stage else cfg.num_hidden_layers
    metadata = {"producer": "mla-deploy", "mla_deploy_version": __version__, "export_id": manifest["export_id"]}
    with WeightsFile(directory / WEIGHTS_FILE) as weights:
        for kind in graph_kinds(plan):
            form = FORMS[kind].format(absorb=plan.absorb.value, prefill=plan.prefill_attention)
            progress(f"building {kind} graph ({form}), writing its weights")
            with progress_bar(1 if kind == io_spec.DRAFT else layers, f"{kind} layers", "layer") as advance:
                graphs[kind] = build_graph(kind, cfg, source.tensor, plan, weights, metadata,
                                           on_layer=lambda i: advance(1), stage=stage)
    size = f"{weights.nbytes / 1e9:.2f} GB" if weights.nbytes >= 1e8 else f"{weights.nbytes / 1e6:.1f} MB"
    progress(f"wrote weights ({size})")
    manifest["weights"].update(bytes=weights.nbytes, block_bytes=integrity.BLOCK_BYTES, digest=integrity.DIGEST,
                               block_digests=integrity.block_digests(directory / WEIGHTS_FILE))
    for kind, model in graphs.items():
        progress(f"saving and checking {kind}.onnx")
        path = directory / io_spec.GRAPH_FILES[kind]
        ir.save(model, path)  # external tensors stay references into weights.bin
        onnx.checker.check_model(str(path), full_check=True)
        manifest["graphs"][kind]["sha256"] = file_sha256(path)
        manifest["graphs"][kind]["op_counts"] = op_counts(model)
    if stage is not None:
        (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


FORMS = {io_spec.PREFILL: "{prefill} attention", io_spec.DECODE: "absorbed, {absorb}",
         io_spec.VERIFY: "absorbed, {absorb}, any number of tokens", io_spec.DRAFT: "the MTP layer, absorbed, {absorb}"}


def graph_kinds(plan: ExportPlan) -> tuple[str, ...]:
    """The graphs an export holds: prefill, decode and verify; the MTP draft where the plan has it. A stage of a
    staged export: prefill and decode (speculative decoding runs on one host)."""
    if plan.stages:
        return io_spec.PREFILL, io_spec.DECODE
    return (io_spec.PREFILL, io_spec.DECODE, io_spec.VERIFY) + ((io_spec.DRAFT,) if plan.draft else ())


def _report_choices(cfg, options: ExportOptions, plan: ExportPlan, progress: Progress) -> None:
    """What each asked-for choice resolved to, and why where auto decided."""
    if AbsorbMode(options.absorb) == AbsorbMode.AUTO:
        fused, factored = (absorbed_weight_bytes(cfg, m) / 1e6 for m in (AbsorbMode.FUSED, AbsorbMode.FACTORED))
        progress(f"absorb auto -> {plan.absorb.value}: attention weights read per decode token and layer, computed "
                 f"from the config: factored {factored:.2f} MB, fused {fused:.2f} MB (bytes decide, not a timing)")
    if plan.quantized_ops:
        progress(
            f"quantized ops: {plan.quantized_ops} ({options.quantized_ops}), {plan.quantization.scale_dtype} scales"
        )
    if cfg.n_routed_experts:
        progress(f"routed experts: {plan.experts} ({options.experts})")
    progress(f"caches: {plan.cache_format.latent} latent, {plan.cache_format.rope} rope ({options.cache_dtype})")
    progress(f"decode attention: {plan.decode_attention} ({options.decode_attention})"
             + (", the cache as MatMul's A operand (long cache)" if plan.long_cache else ""))


def _manifest(cfg, plan: ExportPlan, source_hash: str, export_id: str, ckpt: Checkpoint,
              stage: io_spec.Stage | None = None, staged_export_id: str | None = None) -> dict:
    """The manifest of an export, or of one stage of a staged export (`stage`, and the id of the staged export it
    belongs to)."""
    graphs = {}
    for kind in graph_kinds(plan):
        inputs, outputs = io_spec.graph_io(kind, cfg, plan.cache_format, hidden=plan.draft, stage=stage)
        graphs[kind] = {"file": io_spec.GRAPH_FILES[kind], "inputs": [s.to_dict() for s in inputs],
                        "outputs": [s.to_dict() for s in outputs]}
    return {
        **_common(cfg, plan, source_hash, export_id, ckpt), "weights": {"file": WEIGHTS_FILE}, "graphs": graphs,
        **({"stage": {**stage.to_dict(), "staged_export_id": staged_export_id}} if stage else {}),
    }


def _top_manifest(cfg, plan: ExportPlan, source_hash: str, export_id: str, ckpt: Checkpoint) -> dict:
    """A staged export's own manifest: the plan (its stages' layers in order) and each stage's directory; the graphs
    and weights are in the stages' directories, each with its manifest."""
    manifest = _common(cfg, plan, source_hash, export_id, ckpt)
    for stage, entry in zip(plan.stages, manifest["stages"]):
        entry["directory"] = stage_directory(stage.index)
    return manifest


def stage_directory(index: int) -> str:
    return f"stage-{index}"


def _common(cfg, plan: ExportPlan, source_hash: str, export_id: str, ckpt: Checkpoint) -> dict:
    return {
        "format": "mla-deploy-export", "manifest_version": MANIFEST_VERSION, "mla_deploy_version": __version__,
        "export_id": export_id, "config": cfg.to_dict(), "opset": OPSET, **plan.manifest_fields(cfg),
        "source": {"path": str(ckpt.directory.resolve()), "sha256": source_hash},
    }


def _check_copied_configs(directory: Path) -> list[str]:
    """The tokenizer, generation and tokenizer configs the export copies, read as the runtime reads them: a file it
    would refuse is refused here, before the graphs are written. Returns a note where the checkpoint has no
    tokenizer.json."""
    tokenizer = directory / "tokenizer.json"
    try:
        GenerationDefaults.from_export(directory)
        tokenizer_config(directory)
        if tokenizer.is_file():
            Tokenizer(tokenizer)
            return []
    except ExportLoadError as e:
        raise CheckpointError(str(e)) from None
    return [f"{directory}: no tokenizer.json, so the export takes token ids alone (`run --prompt-ids`, `eval "
            "--ids`); text (`run --prompt`, chat, `eval --text`, serve's text routes) needs one: copy the model's "
            "tokenizer.json in beside config.json and export again"]


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def _fsync_tree(directory: Path) -> None:
    for p in directory.iterdir():
        if p.is_dir():  # a stage of a staged export
            _fsync_tree(p)
            continue
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def _check_output(out: Path, force: bool) -> None:
    """Nothing at `out` (or an empty directory, as `mktemp -d` makes one), or an earlier export there and --force:
    the one thing --force replaces. Anything else is refused, nothing deleted."""
    if not (out.exists() or out.is_symlink()):
        if (why := unwritable_parent(out)) is not None:
            raise ExportError(f"{out}: cannot be created ({why}); choose another output path")
        return
    if not empty_directory(out):
        what = not_an_export(out)
        if what is None and not force:
            raise ExportError(f"{out}: output directory exists (use --force to replace it)")
        if what is not None:
            raise ExportError(f"{out}: {what}; " + ("--force replaces only an earlier mla-deploy export, so nothing "
                                                     "was deleted: " if force else "") + "choose another output path")
    if (why := unreplaceable(out)) is not None:  # the export takes its place by a rename in the parent
        raise ExportError(f"{out}: cannot be replaced ({why}); choose another output path")


def _move_into_place(tmp: Path, out: Path, force: bool) -> None:
    _check_output(out, force)  # still nothing, or an earlier export, after the build
    move_into_place(tmp, out)  # --force: the earlier export swapped out, removed once the new one is in place
