"""Preset configs (data files in mla_deploy/models/presets/) and random-weight checkpoints built from them. Torch-free.

A preset checkpoint is an ordinary HF directory (config.json plus model.safetensors, or shards with a
model.safetensors.index.json, per-expert keys), so it goes through exactly the loading path of a
downloaded one. It is written the way real checkpoints are published: in the preset's `torch_dtype`
(float32 when absent), in shards of at most `SHARD_BYTES`, streaming: each tensor is drawn, written
and dropped in blocks of rows, so memory stays flat whatever the model's size.

Weights: norms 1, V3's router bias 0, every other tensor N(0, initializer_range²) as transformers
initialises DeepSeek models, which keeps activations finite through every layer. Each tensor draws
from its own seed (the preset seed and its name), so `--layers N` writes exactly the first N layers of
the full model.
"""

from __future__ import annotations

import json
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
# numpy imports numpy.random on first use; here, not inside write_random_checkpoint: a KeyboardInterrupt (Ctrl-C, or
# the command line's SIGTERM) raised while that extension initialises is lost, and the interrupted preset ran on to
# the end (measured: 1 in 14-40 presets killed just after they began)
from numpy.random import default_rng

from .checkpoint import expected_tensors, parameter_count
from .config import MLAConfig
from .errors import ConfigError, InputError, MLADeployError
from .partial import (destination, move_into_place, nearest_existing, partial_directory, unreplaceable,
                      unwritable_parent)
from .progress import progress_bar
from .safetensors_io import SafetensorsFile, SafetensorsWriter, float32_to_bf16

MODELS_DIR = Path(__file__).resolve().parent / "models"  # package data: installed with the wheel
PRESET_DIR = MODELS_DIR / "presets"
DEMO_CHECKPOINT = MODELS_DIR / "demo"  # the bundled demo model: `export`'s default checkpoint
SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size
INDEX_FILE = "model.safetensors.index.json"
# what a random checkpoint holds: config.json, its weights in one file or shards, the shards' index
WRITTEN = re.compile(r"config\.json|model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors")
_STORED = {"float32": ("F32", 4), "bfloat16": ("BF16", 2)}
_BLOCK_ELEMENTS = 1 << 22  # rows drawn per block: ~16 MB of float32 at a time


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def preset_config(name: str, layers: int | None = None) -> dict:
    """The preset's HF config.json as a dict; `layers` cuts it to its first N decoder layers."""
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    raw = json.loads(path.read_text())
    raw.pop("_comment", None)
    if layers is not None:
        if not 1 <= layers <= raw["num_hidden_layers"]:
            raise ConfigError(f"--layers {layers}: preset {name} has {raw['num_hidden_layers']} layers; choose 1 to "
                              f"{raw['num_hidden_layers']}")
        raw["num_hidden_layers"] = layers
    return raw


def checkpoint_bytes(cfg: MLAConfig, itemsize: int = 4) -> int:
    """Bytes of every tensor a checkpoint for `cfg` holds, at `itemsize` bytes per element."""
    return parameter_count(cfg) * itemsize


def build_preset(name: str, out: str | Path, seed: int = 0, layers: int | None = None,
                 note: Callable[[str], None] = lambda text: None) -> Path:
    """Write a random-weight checkpoint for preset `name` to `out` (atomic); reused when `out` already holds it.
    `note` hears its size before the write, and any leftover of a killed build it removes."""
    raw = preset_config(name, layers)
    return write_random_checkpoint(raw, out, seed, source=f"preset {name}", note=note)


def random_checkpoint_bytes(raw: dict, source: str = "config") -> int:
    """The bytes of the random checkpoint `raw` describes, in its torch_dtype."""
    return checkpoint_bytes(MLAConfig.from_hf_dict(raw, source=source), _stored(raw, source)[1])


def write_random_checkpoint(raw: dict, out: str | Path, seed: int = 0, source: str = "config",
                            note: Callable[[str], None] = lambda text: None) -> Path:
    """A random-weight checkpoint for the HF config dict `raw`, in its `torch_dtype`, sharded and streamed."""
    out = destination(out)
    cfg = MLAConfig.from_hf_dict(raw, source=source)
    config_text = json.dumps({**raw, "_random_weights": {"seed": seed}}, indent=2) + "\n"
    stored, itemsize = _stored(raw, source)
    dtype = raw.get("torch_dtype", "float32")
    shapes = expected_tensors(cfg)
    shards = _shards(shapes, itemsize)
    if ((out / "config.json").is_file() and (out / "config.json").read_text() == config_text
            and _holds(out, shards)):
        return out  # the same config and seed, its weight files whole
    _check_replaceable(out)
    std = raw.get("initializer_range", 0.02)
    total = checkpoint_bytes(cfg, itemsize)
    _check_room(out, total)
    note(f"writing {total / 1e9:.2f} GB ({dtype}, {len(shards)} file"
         f"{'s' if len(shards) > 1 else ''}) to {out}")
    tmp = partial_directory(out, note, InputError)
    try:
        with progress_bar(total, source, "B") as advance:
            for file, names in shards.items():
                with SafetensorsWriter(tmp / file, {n: (stored, shapes[n]) for n in names}) as writer:
                    for name in writer.names:
                        writer.write_blocks(name, _draw(name, shapes[name], seed, std, dtype))
                        advance(int(np.prod(shapes[name])) * itemsize)
        if len(shards) > 1:
            weight_map = {n: file for file, names in shards.items() for n in names}
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(config_text)
        move_into_place(tmp, out)  # an earlier random checkpoint there: replaced once this one is whole
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise InputError(f"{out}: writing the checkpoint failed ({e.strerror or e}); nothing was left behind, "
                             "and an earlier checkpoint there is as it was") from None
        raise
    return out


def _holds(out: Path, shards: dict[str, list[str]]) -> bool:
    """Whether `out` holds every shard file whole, each with its tensors (a file removed or cut short since the
    checkpoint was written is written again)."""
    for file, names in shards.items():
        try:
            if set(SafetensorsFile(out / file).entries) != set(names):
                return False
        except (OSError, ValueError, MLADeployError):
            return False
    return True


def _stored(raw: dict, source: str) -> tuple[str, int]:
    """The safetensors dtype and item size of `raw`'s torch_dtype."""
    dtype = raw.get("torch_dtype", "float32")
    if dtype not in _STORED:
        raise ConfigError(f"{source}: torch_dtype {dtype!r} is not one of {', '.join(_STORED)}")
    return _STORED[dtype]


def _check_room(out: Path, total: int) -> None:
    """Refuse before writing when the filesystem `out` goes to has less than `total` bytes free (an earlier
    checkpoint at `out`, replaced once the new one is complete, still counts as taken)."""
    free = shutil.disk_usage(nearest_existing(out)).free
    if total > free:
        raise InputError(f"{out}: the checkpoint takes {total / 1e9:.2f} GB and {free / 1e9:.2f} GB are free there; "
                         "choose another output path (nothing was written)")


def _check_replaceable(out: Path) -> None:
    """Only an empty directory or a random checkpoint this module wrote (its config.json records _random_weights)
    may be replaced at `out`: anything else there is the user's, and stays."""
    if not out.exists() and not out.is_symlink():
        if (why := unwritable_parent(out)) is not None:
            raise InputError(f"{out}: cannot be created ({why}); choose another output path (nothing was written)")
        return
    if out.is_symlink() or not out.is_dir():
        raise InputError(f"{out}: exists and is not a directory; choose another output path (nothing was written)")
    if (why := unreplaceable(out)) is not None:  # the checkpoint takes its place by a rename
        raise InputError(f"{out}: cannot be replaced ({why}); choose another output path (nothing was written)")
    if not any(out.iterdir()):
        return
    try:
        earlier = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        earlier = None
    if not isinstance(earlier, dict) or "_random_weights" not in earlier:
        raise InputError(f"{out}: a directory that is not a random checkpoint written by `mla-deploy preset`; choose "
                         "another output path or remove it yourself (nothing was written)")
    others = sorted(p.name for p in out.iterdir() if not WRITTEN.fullmatch(p.name))
    if others:
        listed = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise InputError(f"{out}: a random checkpoint that also holds what `mla-deploy preset` did not write "
                         f"({listed}), which replacing it would delete; move them, or choose another output path "
                         "(nothing was written)")


def _shards(shapes: dict[str, tuple[int, ...]], itemsize: int) -> dict[str, list[str]]:
    """Tensors in module order, filled greedily into shards of at most SHARD_BYTES, named as transformers names them."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * itemsize
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


def _draw(name: str, shape: tuple[int, ...], seed: int, std: float, dtype: str):
    """The tensor's values in blocks of rows (uint16 bits for bfloat16), from its own seeded stream."""
    rows = shape[0]
    per_row = int(np.prod(shape[1:]))
    step = max(1, _BLOCK_ELEMENTS // max(per_row, 1))
    rng = default_rng([seed, zlib.crc32(name.encode())])
    for start in range(0, rows, step):
        block_shape = (min(step, rows - start), *shape[1:])
        if name.endswith("norm.weight") or "layernorm" in name:
            block = np.ones(block_shape, np.float32)
        elif name.endswith("e_score_correction_bias"):
            block = np.zeros(block_shape, np.float32)
        else:
            block = rng.standard_normal(block_shape, dtype=np.float32)
            block *= np.float32(std)
        yield float32_to_bf16(block) if dtype == "bfloat16" else block
