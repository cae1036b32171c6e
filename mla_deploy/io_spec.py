"""The one place graph inputs and outputs are named, with their axes. Exporter, runtime and verifier import it.

Both graphs share one contract over caches that the runtime preallocates:

  input_ids        int64 [batch, seq]           new tokens (decode: seq = 1)
  position_ids     int64 [batch, seq]           RoPE position of each new token
  attention_mask   int64 [batch, capacity]      1 where a cache slot holds a real token
  write_indices    int64 [batch]                cache slot of each row's first new token
  logits_positions int64 [batch, n]             (prefill only) chunk positions whose logits to compute
  past_latent.{i}  float [batch, capacity, kv_lora_rank]       ĉ after kv_a_layernorm
  past_rope.{i}    float [batch, capacity, qk_rope_head_dim]   k_pe after RoPE (rotate-half layout)

  logits           float32 [batch, n or 1, vocab]
  present_latent.{i}, present_rope.{i}: the caches with the new entries written (TensorScatter).
      Bound to the same buffers as past_* through IO binding, the update happens in place.

Query t of row b sits at slot write_indices[b] + t and attends to slots j <= that slot where
attention_mask[b, j] = 1. No decompressed K or V appears in any input or output.
"""

from __future__ import annotations

from dataclasses import dataclass

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
WRITE_INDICES = "write_indices"
LOGITS_POSITIONS = "logits_positions"
LOGITS = "logits"

PREFILL = "prefill"
DECODE = "decode"
DRAFT = "draft"
GRAPH_FILES = {PREFILL: "prefill.onnx", DECODE: "decode.onnx", DRAFT: "draft.onnx"}


def past_latent(layer: int) -> str:
    return f"past_latent.{layer}"


def past_rope(layer: int) -> str:
    return f"past_rope.{layer}"


def present_latent(layer: int) -> str:
    return f"present_latent.{layer}"


def present_rope(layer: int) -> str:
    return f"present_rope.{layer}"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: tuple  # ints and axis names

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def cache_widths(num_layers: int, kv_lora_rank: int, rope_dim: int) -> dict[str, int]:
    """past_* cache name -> width, layer by layer: the latent ĉ, then the roped key."""
    widths = {}
    for i in range(num_layers):
        widths[past_latent(i)] = kv_lora_rank
        widths[past_rope(i)] = rope_dim
    return widths


def graph_io(graph: str, num_layers: int, kv_lora_rank: int, rope_dim: int, vocab: int,
             cache_dtype: str = "float32") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the prefill or decode graph."""
    seq = "seq" if graph == PREFILL else 1
    inputs = [
        TensorSpec(INPUT_IDS, "int64", ("batch", seq)),
        TensorSpec(POSITION_IDS, "int64", ("batch", seq)),
        TensorSpec(ATTENTION_MASK, "int64", ("batch", "capacity")),
        TensorSpec(WRITE_INDICES, "int64", ("batch",)),
    ]
    if graph == PREFILL:
        inputs.append(TensorSpec(LOGITS_POSITIONS, "int64", ("batch", "n_logits")))
    outputs = [TensorSpec(LOGITS, "float32", ("batch", "n_logits" if graph == PREFILL else 1, vocab))]
    presents = dict(cache_pairs(num_layers))
    for past, width in cache_widths(num_layers, kv_lora_rank, rope_dim).items():
        inputs.append(TensorSpec(past, cache_dtype, ("batch", "capacity", width)))
        outputs.append(TensorSpec(presents[past], cache_dtype, ("batch", "capacity", width)))
    return inputs, outputs


def cache_pairs(num_layers: int) -> list[tuple[str, str]]:
    """(past, present) name pairs that alias one buffer when the runtime updates caches in place."""
    pairs = []
    for i in range(num_layers):
        pairs += [(past_latent(i), present_latent(i)), (past_rope(i), present_rope(i))]
    return pairs
