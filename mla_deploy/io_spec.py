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

A staged export (export --stages N) splits the decoder into N stages of contiguous layers, each with its own prefill
and decode graph over the same contract, restricted to its layers' caches (past_latent.{i} for i in the stage's
range, the model's own layer numbers), and joined by the residual stream:

  hidden_states    float32 [batch, seq, hidden_size]   the residual stream before the stage's first layer (input of
                   every stage but the first, in place of input_ids)
  hidden_states_out  the same after its last layer (output of every stage but the last, in place of logits): the
                   next stage's hidden_states

The first stage holds the embedding, the last the final norm and the head (logits, logits_positions).
"""

from __future__ import annotations

from dataclasses import dataclass

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
WRITE_INDICES = "write_indices"
LOGITS_POSITIONS = "logits_positions"
LOGITS = "logits"
HIDDEN_STATES = "hidden_states"
HIDDEN_STATES_OUT = "hidden_states_out"

PREFILL = "prefill"
DECODE = "decode"
GRAPH_FILES = {PREFILL: "prefill.onnx", DECODE: "decode.onnx"}


def past_latent(layer: int) -> str:
    return f"past_latent.{layer}"


def past_rope(layer: int) -> str:
    return f"past_rope.{layer}"


def present_latent(layer: int) -> str:
    return f"present_latent.{layer}"


def present_rope(layer: int) -> str:
    return f"present_rope.{layer}"


@dataclass(frozen=True)
class Stage:
    """Stage `index` of `count`, running layers [first_layer, end_layer) of the model."""

    index: int
    count: int
    first_layer: int
    end_layer: int

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.end_layer)

    @property
    def first(self) -> bool:
        """Takes input_ids through the embedding."""
        return self.index == 0

    @property
    def last(self) -> bool:
        """Ends in the final norm and the head: logits."""
        return self.index == self.count - 1

    def to_dict(self) -> dict:
        return {"index": self.index, "count": self.count, "layers": [self.first_layer, self.end_layer]}

    @classmethod
    def from_dict(cls, d: dict) -> "Stage":
        first, end = d["layers"]
        return cls(int(d["index"]), int(d["count"]), int(first), int(end))

    @classmethod
    def whole(cls, num_layers: int) -> "Stage":
        """The whole model as one stage: what an export without stages runs."""
        return cls(0, 1, 0, num_layers)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: tuple  # ints and axis names

    def to_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def cache_widths(num_layers: int | range, kv_lora_rank: int, rope_dim: int) -> dict[str, int]:
    """past_* cache name -> width, layer by layer: the latent ĉ, then the roped key (layers 0 .. num_layers - 1, or
    the given range of layers)."""
    widths = {}
    for i in (range(num_layers) if isinstance(num_layers, int) else num_layers):
        widths[past_latent(i)] = kv_lora_rank
        widths[past_rope(i)] = rope_dim
    return widths


def graph_io(graph: str, num_layers: int, kv_lora_rank: int, rope_dim: int, vocab: int,
             cache_dtype: str = "float32", stage: Stage | None = None,
             hidden_size: int | None = None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the prefill or decode graph; of one stage's (`hidden_size` wide hidden states between
    stages) for a staged export."""
    stage = stage or Stage.whole(num_layers)
    seq = "seq" if graph == PREFILL else 1
    inputs = [
        TensorSpec(INPUT_IDS, "int64", ("batch", seq)) if stage.first
        else TensorSpec(HIDDEN_STATES, "float32", ("batch", seq, hidden_size)),
        TensorSpec(POSITION_IDS, "int64", ("batch", seq)),
        TensorSpec(ATTENTION_MASK, "int64", ("batch", "capacity")),
        TensorSpec(WRITE_INDICES, "int64", ("batch",)),
    ]
    if graph == PREFILL and stage.last:
        inputs.append(TensorSpec(LOGITS_POSITIONS, "int64", ("batch", "n_logits")))
    outputs = [TensorSpec(LOGITS, "float32", ("batch", "n_logits" if graph == PREFILL else 1, vocab)) if stage.last
               else TensorSpec(HIDDEN_STATES_OUT, "float32", ("batch", seq, hidden_size))]
    presents = dict(cache_pairs(stage.layers))
    for past, width in cache_widths(stage.layers, kv_lora_rank, rope_dim).items():
        inputs.append(TensorSpec(past, cache_dtype, ("batch", "capacity", width)))
        outputs.append(TensorSpec(presents[past], cache_dtype, ("batch", "capacity", width)))
    return inputs, outputs


def cache_pairs(num_layers: int | range) -> list[tuple[str, str]]:
    """(past, present) name pairs that alias one buffer when the runtime updates caches in place, for layers
    0 .. num_layers - 1 (or the given range of layers)."""
    pairs = []
    for i in (range(num_layers) if isinstance(num_layers, int) else num_layers):
        pairs += [(past_latent(i), present_latent(i)), (past_rope(i), present_rope(i))]
    return pairs
