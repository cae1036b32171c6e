"""The torch source model (needs the `export` extra): faithful to transformers, the reference for every export."""

from .cache import LayerCache, new_caches
from .loading import load_model, load_mtp
from .model import AttentionForm, MLAForCausalLM
from .mtp import MTPDraft, MTPLayer

__all__ = ["AttentionForm", "LayerCache", "MLAForCausalLM", "MTPDraft", "MTPLayer", "load_model", "load_mtp", "new_caches"]
