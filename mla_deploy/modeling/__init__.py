"""The torch source model (needs the `export` extra): faithful to transformers, the reference for every export."""

from .cache import LayerCache, new_caches
from .loading import load_model
from .model import AttentionForm, MLAForCausalLM

__all__ = ["AttentionForm", "LayerCache", "MLAForCausalLM", "load_model", "new_caches"]
