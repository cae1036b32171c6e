"""The one place graph inputs and outputs are named, with their axes. Exporter, runtime and verifier import it.

Every graph shares one contract over caches that the runtime preallocates:

  input_ids        int64 [batch, seq]           new tokens (decode: seq = 1)
  position_ids     int64 [batch, seq]           RoPE position of each new token
  attention_mask   int64 [batch, capacity]      1 where a cache slot holds a real token
  write_indices    int64 [batch]                cache slot of each row's first new token
  logits_positions int64 [batch, n]             (prefill and draft) chunk positions whose logits to compute
  past_latent.{i}  float [batch, capacity, kv_lora_rank]       ĉ after kv_a_layernorm
  past_latent_scale.{i} float32 [batch, capacity, 1]           (int8 latent caches only) each entry's scale
  past_rope.{i}    float [batch, capacity, qk_rope_head_dim]   k_pe after RoPE (rotate-half layout)

  logits           float32 [batch, n (prefill, draft) or seq, vocab]
  hidden           float32 [batch, seq (draft: n), hidden_size]   the final hidden state, after the final norm:
                   what the vocabulary projection reads (the MTP draft's input, and the draft's own for chaining);
                   from the main graphs of an export with a draft graph only
  present_latent.{i}, present_latent_scale.{i}, present_rope.{i}: the caches with the new entries written
      (TensorScatter). Bound to the same buffers as past_* through IO binding, the update happens in place.

The caches' element types are a CacheFormat: the latent in float32, float16, bfloat16 or int8, the rope in a float
type. An int8 latent entry is ĉ quantized symmetrically with one float32 scale per token and layer:
scale = max(max |ĉ| / 127, FLT_MIN), code = clip(round_half_even(ĉ / scale), -127, 127), ĉ' = code · scale.
The draft graph's caches (its MTP layer's) are in the same format.

Query t of row b sits at slot write_indices[b] + t and attends to slots j <= that slot where
attention_mask[b, j] = 1. No decompressed K or V appears in any input or output.

The graphs: prefill (any seq; naive or absorbed attention, each call the cheaper; absorbed over an int8 latent cache),
decode (absorbed, seq = 1), verify (absorbed, any seq: speculative decoding's verification pass), and draft, the MTP
module (layer index num_hidden_layers of a V3 checkpoint), whose input_ids are the tokens i + 1 and previous_hidden
[batch, seq, hidden_size] the main model's hidden at i, over its own one-layer cache past_latent.{L} / past_rope.{L},
L = num_hidden_layers.

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

from .config import MLAConfig

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
WRITE_INDICES = "write_indices"
LOGITS_POSITIONS = "logits_positions"
LOGITS = "logits"
HIDDEN = "hidden"
PREVIOUS_HIDDEN = "previous_hidden"
HIDDEN_STATES = "hidden_states"
HIDDEN_STATES_OUT = "hidden_states_out"

PREFILL = "prefill"
DECODE = "decode"
VERIFY = "verify"
DRAFT = "draft"
GRAPH_FILES = {PREFILL: "prefill.onnx", DECODE: "decode.onnx", VERIFY: "verify.onnx", DRAFT: "draft.onnx"}


def past_latent(layer: int) -> str:
    return f"past_latent.{layer}"


def past_rope(layer: int) -> str:
    return f"past_rope.{layer}"


def present_latent(layer: int) -> str:
    return f"present_latent.{layer}"


def present_rope(layer: int) -> str:
    return f"present_rope.{layer}"


def past_latent_scale(layer: int) -> str:
    return f"past_latent_scale.{layer}"


def present_latent_scale(layer: int) -> str:
    return f"present_latent_scale.{layer}"


FLOAT_CACHES = ("float32", "float16", "bfloat16")
QUANTIZED_CACHES = ("int8",)
INT8_MAX = 127  # an int8 latent's codes are in [-127, 127]: symmetric, so -code is a code too


@dataclass(frozen=True)
class CacheFormat:
    """What the caches store: the latent in `latent` (a float type, or int8 with a float32 scale per entry), the
    roped key in `rope` (a float type)."""

    latent: str = "float32"
    rope: str = "float32"

    def __post_init__(self):
        if self.latent not in FLOAT_CACHES + QUANTIZED_CACHES:
            raise ValueError(f"latent cache dtype {self.latent!r}: expected one of "
                             f"{', '.join(FLOAT_CACHES + QUANTIZED_CACHES)}")
        if self.rope not in FLOAT_CACHES:
            raise ValueError(f"rope cache dtype {self.rope!r}: expected one of {', '.join(FLOAT_CACHES)}")

    @classmethod
    def of(cls, cache: "CacheFormat | str") -> "CacheFormat":
        """A format, or one float dtype for both caches."""
        return cache if isinstance(cache, CacheFormat) else cls(cache, cache)

    @property
    def scaled(self) -> bool:
        """The latent is stored as codes with a scale per entry."""
        return self.latent in QUANTIZED_CACHES

    def tensors(self, num_layers: int | range, kv_lora_rank: int, rope_dim: int) -> list["CacheTensor"]:
        """Every cache tensor, layer by layer: the latent, its scales where it has them, the roped key (layers
        0 .. num_layers - 1, or the given range of layers: the draft graph's)."""
        out = []
        for i in (range(num_layers) if isinstance(num_layers, int) else num_layers):
            out.append(CacheTensor(past_latent(i), present_latent(i), self.latent, kv_lora_rank, "latent"))
            if self.scaled:
                out.append(CacheTensor(past_latent_scale(i), present_latent_scale(i), "float32", 1, "scale"))
            out.append(CacheTensor(past_rope(i), present_rope(i), self.rope, rope_dim, "rope"))
        return out

    def bytes_per_token(self, num_layers: int, kv_lora_rank: int, rope_dim: int) -> int:
        """Cache bytes one token takes over every layer."""
        return sum(ITEMSIZE[t.dtype] * t.width for t in self.tensors(num_layers, kv_lora_rank, rope_dim))


ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass(frozen=True)
class CacheTensor:
    """One cache buffer [batch, capacity, width], bound as both `past` and `present`."""

    past: str
    present: str
    dtype: str
    width: int
    role: str  # "latent", "scale" (an int8 latent's, one per entry) or "rope"


def past_of(present: str) -> str:
    """The past_* input whose buffer a present_* output updates."""
    return "past_" + present.removeprefix("present_")


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


def graph_io(graph: str, cfg: MLAConfig, cache_dtype: CacheFormat | str = "float32", hidden: bool = False,
             stage: Stage | None = None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """(inputs, outputs) of the prefill, decode, verify or draft graph for the config `cfg` over caches in
    `cache_dtype` (a CacheFormat, or one float dtype for both caches); `hidden`: the main graphs of an export with a
    draft graph also output the final hidden state (the draft graph always does); `stage`: of that stage of a staged
    export (its prefill and decode graphs)."""
    stage = stage or Stage.whole(cfg.num_hidden_layers)
    seq = 1 if graph == DECODE else "seq"
    inputs = [
        TensorSpec(INPUT_IDS, "int64", ("batch", seq)) if stage.first
        else TensorSpec(HIDDEN_STATES, "float32", ("batch", seq, cfg.hidden_size)),
        TensorSpec(POSITION_IDS, "int64", ("batch", seq)),
        TensorSpec(ATTENTION_MASK, "int64", ("batch", "capacity")),
        TensorSpec(WRITE_INDICES, "int64", ("batch",)),
    ]
    gathered = graph in (PREFILL, DRAFT) and stage.last  # logits at the asked-for positions only
    if gathered:
        inputs.append(TensorSpec(LOGITS_POSITIONS, "int64", ("batch", "n_logits")))
    if graph == DRAFT:
        inputs.append(TensorSpec(PREVIOUS_HIDDEN, "float32", ("batch", seq, cfg.hidden_size)))
    outputs = [TensorSpec(LOGITS, "float32", ("batch", "n_logits" if gathered else seq, cfg.vocab_size)) if stage.last
               else TensorSpec(HIDDEN_STATES_OUT, "float32", ("batch", seq, cfg.hidden_size))]
    if hidden or graph == DRAFT:
        outputs.append(TensorSpec(HIDDEN, "float32", ("batch", "n_logits" if graph == DRAFT else seq, cfg.hidden_size)))
    layers = draft_layers(cfg) if graph == DRAFT else stage.layers
    for cache in CacheFormat.of(cache_dtype).tensors(layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim):
        inputs.append(TensorSpec(cache.past, cache.dtype, ("batch", "capacity", cache.width)))
        outputs.append(TensorSpec(cache.present, cache.dtype, ("batch", "capacity", cache.width)))
    return inputs, outputs


def draft_layers(cfg: MLAConfig) -> range:
    """The checkpoint layer index of the MTP module the draft graph runs: the first after the main layers."""
    return range(cfg.num_hidden_layers, cfg.num_hidden_layers + 1)
