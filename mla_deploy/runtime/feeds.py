"""Graph feeds: building cache inputs, and checking a feed handed in by an app before onnxruntime sees it.

Each problem is reported by input name with what was expected, so a wrong cache never reaches
onnxruntime (whose own message would name a kernel, not the mistake).
"""

from __future__ import annotations

import numpy as np

from .. import io_spec
from ..config import MLAConfig
from ..errors import InputError
from .dtypes import numpy_dtype


def empty_caches(cfg: MLAConfig, batch: int, capacity: int, dtype: io_spec.CacheFormat | str = "float32",
                 layers: range | None = None) -> dict[str, np.ndarray]:
    """Zero-filled cache inputs (past_latent, its scales where int8, past_rope) for every layer (or `layers`: the
    draft's, a stage's), in the export's cache format `dtype` (runtime.dtypes; for one-off graph calls: the Generator
    keeps its own in-place buffers)."""
    tensors = io_spec.CacheFormat.of(dtype).tensors(cfg.num_hidden_layers if layers is None else layers,
                                                    cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    return {t.past: np.zeros((batch, capacity, t.width), numpy_dtype(t.dtype)) for t in tensors}


def prefill_feed(cfg: MLAConfig, ids: np.ndarray, capacity: int | None = None,
                 cache_dtype: io_spec.CacheFormat | str = "float32") -> dict[str, np.ndarray]:
    """Prefill rows `ids` [b, T] (right-padded) from an empty cache of `capacity` slots (default T), scoring
    every position: the feed verification and scoring use."""
    b, t = ids.shape
    capacity = t if capacity is None else capacity
    pos = np.broadcast_to(np.arange(t), (b, t)).copy()  # [b, T]
    return {io_spec.INPUT_IDS: ids, io_spec.POSITION_IDS: pos, io_spec.ATTENTION_MASK: np.ones((b, capacity), np.int64),
            io_spec.WRITE_INDICES: np.zeros(b, np.int64), io_spec.LOGITS_POSITIONS: pos,
            **empty_caches(cfg, b, capacity, cache_dtype)}


def check_feed(kind: str, feed: dict, cfg: MLAConfig, max_seq_len: int,
               cache_dtype: io_spec.CacheFormat | str = "float32", stage: io_spec.Stage | None = None) -> None:
    inputs, _ = io_spec.graph_io(kind, cfg, cache_dtype, stage=stage)
    expected = {s.name: s for s in inputs}
    missing = sorted(expected.keys() - feed.keys())
    unknown = sorted(feed.keys() - expected.keys())
    if missing or unknown:
        raise InputError(f"{kind} inputs: missing {missing}, unknown {unknown}")
    axes: dict[str, tuple[int, str]] = {}  # axis name -> (size, first input that fixed it)
    for name, spec in expected.items():
        value = feed[name]
        if not isinstance(value, np.ndarray):
            raise InputError(f"{name}: expected a numpy array, got {type(value).__name__}")
        if value.dtype != numpy_dtype(spec.dtype):
            held = " (bfloat16 bit patterns)" if spec.dtype == "bfloat16" else ""
            raise InputError(
                f"{name}: dtype {value.dtype}, expected {spec.dtype}: numpy {numpy_dtype(spec.dtype)}{held}"
            )
        if value.ndim != len(spec.shape):
            raise InputError(f"{name}: shape {list(value.shape)}, expected rank {len(spec.shape)} {list(spec.shape)}")
        for size, axis in zip(value.shape, spec.shape):
            if isinstance(axis, int):
                if size != axis:
                    raise InputError(f"{name}: shape {list(value.shape)}, expected {list(spec.shape)}")
            elif axis in axes and axes[axis][0] != size:
                raise InputError(
                    f"{name}: {axis} is {size} but {axes[axis][1]} has {axis} {axes[axis][0]}: the inputs disagree"
                )
            else:
                axes.setdefault(axis, (size, name))
    _check_values(feed, axes, cfg, max_seq_len)


def _check_values(feed: dict, axes: dict, cfg: MLAConfig, max_seq_len: int) -> None:
    pos = feed[io_spec.POSITION_IDS]
    new = io_spec.INPUT_IDS if io_spec.INPUT_IDS in feed else io_spec.HIDDEN_STATES  # a later stage's: hidden states
    if feed[new].size == 0:
        raise InputError(f"{new}: empty; at least one token per row")
    if io_spec.INPUT_IDS in feed:
        ids = feed[io_spec.INPUT_IDS]
        bad = np.argwhere((ids < 0) | (ids >= cfg.vocab_size))
        if len(bad):
            r, t = bad[0]
            raise InputError(f"{io_spec.INPUT_IDS}[{r}, {t}] = {ids[r, t]}: outside the vocabulary "
                             f"[0, {cfg.vocab_size})")
    if pos.min() < 0 or pos.max() >= max_seq_len:
        raise InputError(f"{io_spec.POSITION_IDS}: values must be in [0, {max_seq_len}) (the export's maximum length), "
                         f"got [{pos.min()}, {pos.max()}]")
    write = feed[io_spec.WRITE_INDICES]
    capacity, seq = axes["capacity"][0], pos.shape[1]
    if write.min() < 0 or (write + seq).max() > capacity:
        raise InputError(f"{io_spec.WRITE_INDICES}: each row writes {seq} slots from its index; indices "
                         f"[{write.min()}, {write.max()}] do not fit a cache of capacity {capacity}")
    if io_spec.LOGITS_POSITIONS in feed:
        lp = feed[io_spec.LOGITS_POSITIONS]
        if lp.size and (lp.min() < 0 or lp.max() >= seq):
            raise InputError(f"{io_spec.LOGITS_POSITIONS}: values must be in [0, {seq}), got [{lp.min()}, {lp.max()}]")
