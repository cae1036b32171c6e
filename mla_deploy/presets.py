"""Preset configs (data files in models/presets/) and random-weight checkpoints built from them. Torch-free.

A preset checkpoint is an ordinary HF directory (config.json + model.safetensors with per-expert
keys), so it goes through exactly the loading path of a downloaded one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from .checkpoint import expected_tensors
from .config import MLAConfig
from .errors import ConfigError
from .safetensors_io import write_safetensors

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
PRESET_DIR = MODELS_DIR / "presets"
DEMO_CHECKPOINT = MODELS_DIR / "demo"  # the bundled demo model: `export`'s default checkpoint


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def preset_config(name: str) -> dict:
    path = PRESET_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    raw = json.loads(path.read_text())
    raw.pop("_comment", None)
    return raw


def checkpoint_bytes(cfg: MLAConfig, itemsize: int = 4) -> int:
    """Bytes of every tensor a checkpoint for `cfg` holds, at `itemsize` bytes per element."""
    return sum(int(np.prod(shape)) for shape in expected_tensors(cfg).values()) * itemsize


def build_preset(name: str, out: str | Path, seed: int = 0, std: float = 0.02) -> Path:
    """Write a random-weight checkpoint for preset `name` (norm weights 1, the rest N(0, std²)); reused if present."""
    out = Path(out)
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    raw = preset_config(name)
    cfg = MLAConfig.from_hf_dict(raw, source=f"preset {name}")
    rng = np.random.default_rng(seed)
    tensors = {}
    for tensor_name, shape in expected_tensors(cfg).items():
        if tensor_name.endswith("norm.weight") or "layernorm" in tensor_name:
            tensors[tensor_name] = np.ones(shape, np.float32)
        elif tensor_name.endswith("e_score_correction_bias"):
            tensors[tensor_name] = np.zeros(shape, np.float32)
        else:
            tensors[tensor_name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_safetensors(tmp / "model.safetensors", tensors)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
