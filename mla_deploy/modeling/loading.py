"""Build the torch model from a checkpoint directory (weights checked by mla_deploy.checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import Checkpoint
from .model import MLAForCausalLM


def load_model(source: str | Path | Checkpoint) -> MLAForCausalLM:
    """A float32 MLAForCausalLM in eval mode, weights from a checked checkpoint."""
    ckpt = source if isinstance(source, Checkpoint) else Checkpoint(source)
    with torch.device("meta"):
        model = MLAForCausalLM(ckpt.config)
    state = {name: torch.from_numpy(ckpt.tensor(name)) for name in ckpt.names()}
    if ckpt.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.rope = type(model.rope)(ckpt.config)  # buffers were built on meta
    if ckpt.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)
