"""Build the torch model from a checkpoint directory (weights checked by mla_deploy.checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint import Checkpoint
from ..errors import CheckpointError
from .model import MLAForCausalLM
from .mtp import MTPDraft, MTPLayer
from .rope import RopeTables


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


def load_mtp(source: str | Path | Checkpoint) -> MTPDraft:
    """The checkpoint's MTP layer (modeling.mtp) with the embedding and output layer it shares, float32, in eval mode;
    the main layers are not read. `source` may be any reader with `config`, `has_mtp`, `mtp_names()` and
    `tensor(name)` (verification passes a rounded or dequantized checkpoint). CheckpointError where it has none."""
    ckpt = source if not isinstance(source, (str, Path)) else Checkpoint(source)
    cfg = ckpt.config
    if not ckpt.has_mtp:
        raise CheckpointError(f"{source}: no multi-token-prediction layer (layer {cfg.num_hidden_layers}) in this "
                              "checkpoint")
    with torch.device("meta"):
        layer = MTPLayer(cfg)
        embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    layer.load_state_dict({n.removeprefix(prefix): torch.from_numpy(ckpt.tensor(n)) for n in ckpt.mtp_names()},
                          strict=True, assign=True)
    fused = getattr(ckpt, "absorbed_matrices", lambda i: None)(cfg.num_hidden_layers)  # a quantized fused export's
    if fused is not None:
        layer.self_attn.fused = tuple(torch.from_numpy(w) for w in fused)
    embed.load_state_dict({"weight": torch.from_numpy(ckpt.tensor("model.embed_tokens.weight"))}, assign=True)
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head.load_state_dict({"weight": embed.weight if cfg.tie_word_embeddings else torch.from_numpy(ckpt.tensor(head_name))},
                         assign=True)
    return MTPDraft(layer, embed, head, RopeTables(cfg)).eval().requires_grad_(False)
