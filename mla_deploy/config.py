"""MLAConfig: one flat dataclass with DeepSeek's own field names, read from a Hugging Face config.json.

Both config forms are read: transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x
(`rope_parameters`); where a config holds both, a non-empty `rope_scaling` replaces `rope_parameters`, as
transformers reads it. Defaults for fields a config.json may omit are the ones transformers'
DeepseekV2Config / DeepseekV3Config use, so a checkpoint means the same thing here as there; a field of the
wrong type (a string "false", a null count) is refused by name, as transformers' strict configs refuse it.
Torch-free: the runtime reads this from the export manifest.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import ConfigError, read_json_object

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
ROPE_TYPES = ("default", "yarn")

# Routing that each transformers architecture implements (topk_method -> scoring_func).
ROUTERS = {
    "deepseek_v2": {"greedy": "softmax", "group_limited_greedy": "softmax"},
    "deepseek_v3": {"noaux_tc": "sigmoid"},
}

# transformers' class defaults for fields a config.json may leave out.
_DEFAULTS = {
    "deepseek_v2": dict(
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, first_k_dense_replace=0,
        n_routed_experts=64, n_shared_experts=2, routed_scaling_factor=1.0, topk_method="greedy",
        scoring_func="softmax", norm_topk_prob=False, n_group=None, topk_group=None,
        num_experts_per_tok=None, moe_intermediate_size=1407, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, bos_token_id=1, eos_token_id=2,
        rope_interleave=True, hidden_act="silu", max_position_embeddings=2048,
    ),
    "deepseek_v3": dict(
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, first_k_dense_replace=3,
        n_routed_experts=256, n_shared_experts=1, routed_scaling_factor=2.5, topk_method="noaux_tc",
        scoring_func="sigmoid", norm_topk_prob=True, n_group=8, topk_group=4, num_experts_per_tok=8,
        moe_intermediate_size=2048, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, bos_token_id=0, eos_token_id=1, rope_interleave=True,
        hidden_act="silu", max_position_embeddings=4096,
    ),
}

# the optional fields that decide which tensors a checkpoint holds, and their shapes
SHAPE_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "first_k_dense_replace",
                "tie_word_embeddings")


def defaulted_shape_fields(raw: dict) -> dict:
    """SHAPE_FIELDS that a config.json leaves out, with the defaults (transformers' config classes') taken for them."""
    defaults = _DEFAULTS.get(raw.get("model_type"), {})
    return {k: defaults[k] for k in SHAPE_FIELDS if k in defaults and k not in raw}


# Fields with no sensible default: a config.json without them is refused.
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

# each field's type, as validate() checks it (the enumerated strings are checked against what is supported)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings",
                  "moe_intermediate_size")
_OPTIONAL_POSITIVE_INTS = ("q_lora_rank", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
                           "original_max_position_embeddings")
_COUNTS = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")  # integers >= 0
_BOOLS = ("tie_word_embeddings", "norm_topk_prob", "rope_interleave")
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "rope_factor", "beta_fast", "beta_slow")
_NUMBERS = ("routed_scaling_factor",)  # finite: 0 makes every routed expert's weight 0 (a test's edge)
_OPTIONAL_NUMBERS = ("mscale", "mscale_all_dim", "attention_factor")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class MLAConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # mixture of experts
    n_routed_experts: int | None
    n_shared_experts: int
    num_experts_per_tok: int | None
    moe_intermediate_size: int
    first_k_dense_replace: int
    topk_method: str
    scoring_func: str
    n_group: int | None
    topk_group: int | None
    norm_topk_prob: bool
    routed_scaling_factor: float
    # norms, embeddings, tokens
    rms_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: tuple[int, ...]
    # positions: rope_type "default" or "yarn"; the yarn fields are unused for "default"
    max_position_embeddings: int
    rope_theta: float
    rope_interleave: bool
    rope_type: str = "default"
    rope_factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    num_nextn_predict_layers: int = 0

    # ---- derived sizes (the names of mla.md) ----
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_norm_eps(self) -> float:
        """The eps of q_a_layernorm and kv_a_layernorm: transformers and DeepSeek's code build those two with
        RMSNorm's default, 1e-6, whatever rms_norm_eps says (which only the decoder layers' and final norms read)."""
        return 1e-6

    @property
    def latent_cache_width(self) -> int:
        """Elements cached per token per layer: d_c + d_r."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mha_cache_width(self) -> int:
        """Elements a decompressed K/V cache would hold per token per layer: n_h·(d_nope + d_r + d_v)."""
        return self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts is not None and layer >= self.first_k_dense_replace

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_id"] = list(self.eos_token_id)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MLAConfig":
        """Inverse of to_dict (the manifest form); validates."""
        d = dict(d)
        d["eos_token_id"] = tuple(d.get("eos_token_id") or ())
        cfg = cls(**d)
        cfg.validate()
        return cfg

    # ---- reading an HF config.json ----
    @classmethod
    def from_hf_json(cls, path: str | Path) -> "MLAConfig":
        raw = read_json_object(path, ConfigError, "model config (is this a checkpoint directory?)")
        return cls.from_hf_dict(raw, source=str(path))

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config.json") -> "MLAConfig":
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {model_type!r} is not an MLA model; expected one of {MODEL_TYPES}")
        missing = [k for k in _REQUIRED if raw.get(k) is None]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
        defaults = _DEFAULTS[model_type]

        def get(key):
            return raw[key] if key in raw else defaults[key]

        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: get(k) for k in defaults if k in fields}
        values.update({k: raw[k] for k in _REQUIRED})
        values["model_type"] = model_type
        if "num_experts" in raw and "n_routed_experts" not in raw:  # transformers' alias
            values["n_routed_experts"] = raw["num_experts"]
        values["num_nextn_predict_layers"] = raw.get("num_nextn_predict_layers") or 0
        eos = values["eos_token_id"]
        values["eos_token_id"] = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        values.update(_read_rope(raw, model_type, source))
        for flag in ("attention_bias", "mlp_bias"):
            if raw.get(flag):
                raise ConfigError(f"{source}: {flag}=true is not supported (no DeepSeek checkpoint uses it)")
        if raw.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"{source}: moe_layer_freq={raw['moe_layer_freq']} is not supported (only 1)")
        cfg = cls(**values)
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        def bad(msg):
            raise ConfigError(f"{source}: {msg}")

        self._validate_types(bad)
        if self.qk_rope_head_dim % 2:
            bad(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.hidden_act != "silu":
            bad(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        if self.rope_type not in ROPE_TYPES:
            bad(f"rope type {self.rope_type!r} is not supported; expected one of {ROPE_TYPES}")
        if self.rope_type == "yarn" and not self.original_max_position_embeddings:
            bad("yarn rope scaling needs original_max_position_embeddings")
        self._validate_moe(bad)

    def _validate_types(self, bad) -> None:
        for name in _POSITIVE_INTS + _OPTIONAL_POSITIVE_INTS:
            value = getattr(self, name)
            if not (value is None and name in _OPTIONAL_POSITIVE_INTS) and not (_is_int(value) and value > 0):
                null = (" null (no query LoRA) or" if name == "q_lora_rank" else
                        " null or" if name in _OPTIONAL_POSITIVE_INTS else "")
                bad(f"{name} must be{null} a positive integer, got {value!r}")
        for name in _COUNTS:
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 0):
                bad(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in _POSITIVE_NUMBERS + _NUMBERS + _OPTIONAL_NUMBERS:
            value = getattr(self, name)
            if name in _OPTIONAL_NUMBERS and value is None:
                continue
            if not _is_number(value) or (name in _POSITIVE_NUMBERS and value <= 0):
                bad(f"{name} must be a {'positive ' if name in _POSITIVE_NUMBERS else ''}number, got {value!r}")
        if self.bos_token_id is not None and not (_is_int(self.bos_token_id) and self.bos_token_id >= 0):
            bad(f"bos_token_id must be null or a token id (an integer >= 0), got {self.bos_token_id!r}")
        if not all(_is_int(t) and t >= 0 for t in self.eos_token_id):
            bad(f"eos_token_id must be a token id or a list of them (integers >= 0), got {list(self.eos_token_id)!r}")

    def _validate_moe(self, bad) -> None:
        if self.n_routed_experts is None:
            if self.first_k_dense_replace < self.num_hidden_layers:
                bad("n_routed_experts is null but first_k_dense_replace leaves MoE layers")
            return
        routers = ROUTERS[self.model_type]
        if self.topk_method not in routers:
            bad(
                f"topk_method {self.topk_method!r} is not supported for {self.model_type}; expected one of "
                f"{tuple(routers)}"
            )
        if self.scoring_func != routers[self.topk_method]:
            bad(f"scoring_func {self.scoring_func!r} is not supported with topk_method {self.topk_method!r} "
                f"(expected {routers[self.topk_method]!r})")
        if self.scoring_func == "softmax" and self.norm_topk_prob:
            bad("norm_topk_prob: true with softmax routing is read two ways (transformers scales the top-k weights by "
                "routed_scaling_factor regardless; DeepSeek's own V2 code normalizes them instead): every released V2 "
                "checkpoint has false, and this one is refused rather than read one way unsaid")
        if not self.num_experts_per_tok or self.num_experts_per_tok > self.n_routed_experts:
            bad(
                f"num_experts_per_tok={self.num_experts_per_tok!r} must be between 1 and "
                f"n_routed_experts={self.n_routed_experts}"
            )
        if self.topk_method in ("group_limited_greedy", "noaux_tc"):
            if not self.n_group or not self.topk_group:
                bad(f"topk_method {self.topk_method!r} needs n_group and topk_group")
            if self.n_routed_experts % self.n_group:
                bad(f"n_routed_experts={self.n_routed_experts} is not divisible by n_group={self.n_group}")
            if self.topk_group > self.n_group:
                bad(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
            if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
                bad("noaux_tc scores each group by its top-2 experts: every group needs at least 2")


def _read_rope(raw: dict, model_type: str, source: str) -> dict:
    """RoPE fields from either `rope_parameters` (transformers 5.x) or `rope_scaling` + `rope_theta` (4.x)."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"{source}: rope_scaling must be an object or null")
    merged = dict(scaling or params or {})  # transformers: a non-empty rope_scaling replaces rope_parameters
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    theta = merged.get("rope_theta", raw.get("rope_theta", _DEFAULTS[model_type]["rope_theta"]))
    out = dict(rope_theta=_float(theta), rope_type=rope_type)
    if model_type == "deepseek_v2":
        out["rope_interleave"] = True  # transformers' DeepseekV2 always rotates interleaved pairs
    elif "rope_interleave" in raw:
        out["rope_interleave"] = raw["rope_interleave"]
    if rope_type == "yarn":
        if merged.get("factor") is None:
            raise ConfigError(f"{source}: yarn rope scaling needs 'factor'")
        if merged.get("truncate", True) is not True:  # transformers' option; DeepSeek's YaRN always rounds
            raise ConfigError(f"{source}: yarn 'truncate': {merged['truncate']!r} is not supported (the correction "
                              "range is rounded to whole dimensions, as DeepSeek's YaRN rounds it)")
        out.update(
            rope_factor=_float(merged["factor"]),
            # where the rope block leaves it out, transformers' config-level value, else the model's own length
            original_max_position_embeddings=merged.get("original_max_position_embeddings", raw.get(
                "original_max_position_embeddings", raw.get("max_position_embeddings",
                                                            _DEFAULTS[model_type]["max_position_embeddings"]))),
            beta_fast=_float(merged.get("beta_fast") or 32),
            beta_slow=_float(merged.get("beta_slow") or 1),
            mscale=merged.get("mscale"),
            mscale_all_dim=merged.get("mscale_all_dim"),
            attention_factor=merged.get("attention_factor"),
        )
    elif rope_type != "default":
        raise ConfigError(f"{source}: rope type {rope_type!r} is not supported; expected one of {ROPE_TYPES}")
    return out


def _float(value):
    """A number as float; anything else as it is, for validate() to name."""
    return float(value) if _is_number(value) else value
