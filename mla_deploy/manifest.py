"""The export manifest: what an export directory holds, read and checked before any session is created.

Torch-free (the runtime uses it). A manifest names the model config, the graphs with every input and
output, the absorb mode, dtype, opset, maximum length, the source checkpoint's hash and an export id
that is also stamped into each graph's metadata, so graphs from different exports are refused.

A staged export's manifest names no graphs: it orders its stages, each a directory with an export's files and
manifest (its own export id, and the staged export's id it belongs to, so stages of different exports are refused).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from . import integrity, io_spec
from .config import MLAConfig
from .errors import ExportLoadError, MLADeployError, read_json

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 2  # 2: per-block weight digests (mla_deploy.integrity)
WEIGHTS_FILE = "weights.bin"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def file_sha256(path: Path) -> str:
    """The digest the manifest records for each graph file (written by the exporter, checked on load)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def not_an_export(path: Path) -> str | None:
    """None where `path` is an mla-deploy export directory (its manifest.json names the format, of any version: an
    old export is still one); else what it is, for an error message."""
    if path.is_symlink():
        return "is a symbolic link"
    if path.is_file():
        return "is a file"
    if not path.is_dir():
        return "is neither a file nor a directory"
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        return f"is a directory with no {MANIFEST_FILE} (not an mla-deploy export)"
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return f"is a directory whose {MANIFEST_FILE} is unreadable or not JSON"
    if not isinstance(recorded, dict) or recorded.get("format") != "mla-deploy-export":
        return f"is a directory whose {MANIFEST_FILE} is not an mla-deploy manifest"
    return None


def read_manifest(directory: str | Path) -> dict:
    directory = Path(directory)
    path = directory / MANIFEST_FILE
    if directory.exists() and not directory.is_dir():
        raise ExportLoadError(
            f"{directory}: is a file; expected an export directory (the output of `mla-deploy export`)"
        )
    if not directory.is_dir():
        raise ExportLoadError(f"{directory}: export directory does not exist")
    manifest = read_json(path, ExportLoadError, "manifest (is this an mla-deploy export?)")
    if not isinstance(manifest, dict) or manifest.get("format") != "mla-deploy-export":
        raise ExportLoadError(f"{path}: not an mla-deploy manifest")
    version = manifest.get("manifest_version")
    if not isinstance(version, int) or version > MANIFEST_VERSION:
        raise ExportLoadError(
            f"{path}: manifest_version {version!r} was written by mla-deploy {manifest.get('mla_deploy_version')}; "
            f"this mla-deploy reads version {MANIFEST_VERSION}: upgrade mla-deploy"
        )
    if version < MANIFEST_VERSION:
        raise ExportLoadError(
            f"{path}: manifest_version {version} (mla-deploy {manifest.get('mla_deploy_version')}) has no weight "
            f"checksums; re-export the checkpoint with this mla-deploy"
        )
    try:
        manifest["config_obj"] = MLAConfig.from_dict(manifest["config"])
        int(manifest["max_seq_len"])
        if is_staged(manifest):
            for entry in manifest["stages"]:
                str(entry["directory"]), str(entry["export_id"]), [int(x) for x in entry["layers"]]
        else:
            for kind in (io_spec.PREFILL, io_spec.DECODE):
                manifest["graphs"][kind]["file"]
            manifest["weights"]["file"], manifest["weights"]["bytes"]
            if manifest["dtype"] not in io_spec.FLOAT_CACHES:  # the weights' float type (quantized: their scales')
                raise ValueError(f"dtype {manifest['dtype']!r}: expected one of {', '.join(io_spec.FLOAT_CACHES)}")
            cache_format(manifest)
    except (KeyError, TypeError, ValueError, MLADeployError) as e:
        raise ExportLoadError(f"{path}: incomplete or invalid manifest ({e})") from None
    return manifest


def is_staged(manifest: dict) -> bool:
    """A staged export's own manifest (its stages in directories of their own), not one stage's or a whole export's."""
    return "graphs" not in manifest and isinstance(manifest.get("stages"), list)


def stage_of(manifest: dict) -> io_spec.Stage | None:
    """The stage an export directory holds (its manifest's `stage`), or None for a whole export."""
    recorded = manifest.get("stage")
    return None if recorded is None else io_spec.Stage.from_dict(recorded)


def require_whole(directory: str | Path, manifest: dict, what: str) -> None:
    """ExportLoadError where `directory` holds one stage of a staged export, which `what` cannot run: its graphs
    take or give hidden states, not tokens and logits."""
    stage = stage_of(manifest)
    if stage is not None and stage.count > 1:
        raise ExportLoadError(
            f"{directory}: stage {stage.index} of {stage.count} (layers {stage.first_layer}-{stage.end_layer - 1}) of "
            f"a staged export; {what} runs the whole model: pass the staged export's directory "
            f"({Path(directory).parent})")


def read_stage(directory: str | Path, manifest: dict, index: int) -> tuple[Path, dict]:
    """Stage `index` of the staged export at `directory` (manifest: read_manifest's): its directory and manifest,
    checked to be that stage of that export."""
    entry = manifest["stages"][index]
    stage_dir = Path(directory) / entry["directory"]
    stage_manifest = read_manifest(stage_dir)
    stage = stage_of(stage_manifest)
    recorded = stage_manifest.get("stage") or {}
    if (stage is None or stage.index != index or list(stage.layers) != list(range(*entry["layers"]))
            or recorded.get("staged_export_id") != manifest["export_id"]
            or stage_manifest["export_id"] != entry["export_id"]):
        raise ExportLoadError(f"{stage_dir}: not stage {index} (layers {entry['layers'][0]}-{entry['layers'][1] - 1}) "
                              f"of the export {manifest['export_id']!r} at {directory}: stages of different exports "
                              f"cannot be mixed")
    return stage_dir, stage_manifest


def cache_format(manifest: dict) -> io_spec.CacheFormat:
    """The caches' element types as the manifest's precision records them (`caches`: the latent's, `rope_cache`: the
    roped key's, the latent's where not recorded)."""
    precision = manifest.get("precision") or {}
    latent = precision.get("caches", manifest["dtype"])
    return io_spec.CacheFormat(latent, precision.get("rope_cache", latent))


def check_files(directory: Path, manifest: dict, check_weights: str = "sampled") -> None:
    """Every file the manifest names exists; graph hashes match; the weights file's size and blocks match
    (all blocks, or a sample of a large file: mla_deploy.integrity); of every stage, for a staged export. One
    ExportLoadError names every file that fails, not the first alone."""
    problems = _file_problems(directory, manifest, check_weights)
    if len(problems) > 1:
        raise ExportLoadError(f"{len(problems)} files fail their check: " + " | ".join(problems))
    if problems:
        raise ExportLoadError(problems[0])


def _file_problems(directory: Path, manifest: dict, check_weights: str) -> list[str]:
    problems = []
    for name in manifest.get("tokenizer") or []:  # copied from the checkpoint by the export
        if not (directory / name).is_file():
            problems.append(f"{directory / name}: missing (the manifest lists it among the tokenizer and generation "
                            "files copied from the checkpoint)")
    if is_staged(manifest):
        for index in range(len(manifest["stages"])):
            try:
                problems += _file_problems(*read_stage(directory, manifest, index), check_weights)
            except ExportLoadError as e:  # the stage's manifest unreadable, or another export's stage
                problems.append(str(e))
        return problems
    for kind, entry in manifest["graphs"].items():
        path = directory / entry["file"]
        if not path.is_file():
            problems.append(f"{path}: missing {kind} graph")
            continue
        try:
            digest = file_sha256(path)
        except OSError as e:
            problems.append(f"{path}: cannot read the {kind} graph ({e.strerror})")
            continue
        if entry.get("sha256") != digest:
            problems.append(f"{path}: does not match the manifest (sha256 differs): corrupted or from another export")
    weights = directory / manifest["weights"]["file"]
    if not weights.is_file():
        problems.append(f"{weights}: missing external weight data")
    else:
        try:
            integrity.check_weights(weights, manifest["weights"], check_weights)
        except ExportLoadError as e:
            problems.append(str(e))
    return problems


def check_export(directory: str | Path) -> dict:
    """The full check `mla-deploy check` runs: manifest, graph hashes, every block of the weights file."""
    import time

    directory = Path(directory)
    start = time.perf_counter()
    manifest = read_manifest(directory)
    check_files(directory, manifest, "full")
    parts = ([read_stage(directory, manifest, i)[1] for i in range(len(manifest["stages"]))] if is_staged(manifest)
             else [manifest])
    return {"blocks": sum(len(m["weights"]["block_digests"]) for m in parts),
            "bytes": sum(m["weights"]["bytes"] for m in parts), "seconds": time.perf_counter() - start}
