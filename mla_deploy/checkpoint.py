"""Hugging Face checkpoints: config.json plus model.safetensors or a sharded index. Torch-free.

The tensor names and shapes a config implies are computed here (`expected_tensors`), so the
torch loader and the exporter check a checkpoint the same way and report every missing,
unexpected or misshapen tensor in one error. Experts may be stored per expert (the layout of
real checkpoints and `save_pretrained`) or packed (`mlp.experts.gate_up_proj` [E, 2I, D] and
`mlp.experts.down_proj` [E, D, I]); both read as per-expert tensors. FP8 block-scaled weights (DeepSeek-V3 /
R1, `quantization_config` fp8) read as float32, dequantized by `mla_deploy.fp8` one block row at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import numpy as np

from . import fp8
from .config import MLAConfig, defaulted_shape_fields
from .errors import CheckpointError, read_json
from .safetensors_io import SafetensorsFile, bf16_to_float32

PICKLE_PATTERNS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_PACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def expected_tensors(cfg: MLAConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `cfg` holds for generation, with its shape (HF naming, per-expert experts); the
    MTP layer's apart (mtp_tensors)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    for i in range(cfg.num_hidden_layers):
        out.update(layer_tensors(cfg, i))
    return out


def mtp_tensors(cfg: MLAConfig) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction layer's tensors (DeepSeek-V3's layout, layer index num_hidden_layers): a decoder
    layer plus enorm, hnorm, eh_proj [d, 2d] and shared_head.norm. Its embed_tokens and shared_head.head, which
    DeepSeek-V3 stores as copies of the main model's, are optional (MTP_SHARED): the main model's are used."""
    d, layer = cfg.hidden_size, cfg.num_hidden_layers
    p = f"model.layers.{layer}."
    return {**layer_tensors(cfg, layer), p + "enorm.weight": (d,), p + "hnorm.weight": (d,),
            p + "eh_proj.weight": (d, 2 * d), p + "shared_head.norm.weight": (d,)}


FLOAT_DTYPES = ("F32", "F16", "BF16", "F8_E4M3", "F64")  # safetensors' names; float8 with its block scales
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
MTP_OWN = ("enorm.", "hnorm.", "eh_proj.")  # what only an MTP module holds


def layer_tensors(cfg: MLAConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Decoder layer i's tensors: norms, attention, dense MLP or MoE."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    a = p + "self_attn."
    if cfg.q_lora_rank is None:
        out[a + "q_proj.weight"] = (h * cfg.qk_head_dim, d)
    else:
        out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, d)
        out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        out[a + "q_b_proj.weight"] = (h * cfg.qk_head_dim, cfg.q_lora_rank)
    out[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
    out[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    out[a + "kv_b_proj.weight"] = (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    out[a + "o_proj.weight"] = (d, h * cfg.v_head_dim)
    m = p + "mlp."
    if not cfg.is_moe_layer(i):
        out.update(_swiglu(m, d, cfg.intermediate_size))
        return out
    out[m + "gate.weight"] = (cfg.n_routed_experts, d)
    if cfg.topk_method == "noaux_tc":
        out[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
    for e in range(cfg.n_routed_experts):
        out.update(_swiglu(f"{m}experts.{e}.", d, cfg.moe_intermediate_size))
    if cfg.n_shared_experts:
        out.update(_swiglu(m + "shared_experts.", d, cfg.moe_intermediate_size * cfg.n_shared_experts))
    return out


def parameter_count(cfg: MLAConfig) -> int:
    """Elements of every tensor a checkpoint for `cfg` holds."""
    return sum(int(np.prod(shape)) for shape in expected_tensors(cfg).values())


def _swiglu(prefix: str, d: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, d),
        prefix + "up_proj.weight": (inter, d),
        prefix + "down_proj.weight": (d, inter),
    }


class Checkpoint:
    """A checkpoint directory, checked on open: every tensor present, nothing unexpected, every shape right."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if self.directory.is_file():
            raise CheckpointError(f"{self.directory}: is a file; expected the checkpoint's directory (the one holding "
                                  f"config.json and the safetensors){_parent_hint(self.directory)}")
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: checkpoint directory does not exist")
        self.config = MLAConfig.from_hf_json(self.directory / "config.json")
        raw_config = read_json(self.directory / "config.json", CheckpointError, "model config")
        self._defaulted = defaulted_shape_fields(raw_config)
        self.fp8_block = fp8.block_size(raw_config, str(self.directory / "config.json"))  # None: not an FP8 checkpoint
        self.files = _safetensors_files(self.directory)
        self.notes: list[str] = []
        self._where: dict[str, tuple[SafetensorsFile, str, slice | None]] = {}
        self._mtp_prefix = f"model.layers.{self.config.num_hidden_layers}."
        self._scales: dict[str, tuple[SafetensorsFile, str]] = {}  # FP8 weight name -> its weight_scale_inv
        self._cut = False  # layers past num_hidden_layers that are no MTP module: a deeper model read cut short
        self._index_tensors()
        self._check_against_config()
        self._check_fp8()

    # ---- reading ----
    def names(self) -> list[str]:
        """The main model's tensors (expected_tensors); the MTP layer's: mtp_names()."""
        return [n for n in self._where if not n.startswith(self._mtp_prefix)]

    def mtp_names(self) -> list[str]:
        """The MTP layer's tensors (mtp_tensors), where the checkpoint has them; empty otherwise."""
        return [n for n in self._where if n.startswith(self._mtp_prefix)]

    @property
    def has_mtp(self) -> bool:
        return bool(self.mtp_names())

    def tensor(self, name: str) -> np.ndarray:
        """One tensor as float32, in the HF per-expert naming (an FP8 weight dequantized with its block scales);
        CheckpointError where it holds NaN or infinity."""
        file, stored, rows = self._where[name]
        if name in self._scales:
            arr = self._fp8_tensor(name)
        else:
            arr = file.float32(stored) if rows is None else _packed_rows(file, stored, rows)
        _check_finite(arr, name, self.directory)
        return arr

    def _fp8_tensor(self, name: str) -> np.ndarray:
        """Dequantized one block row at a time: memory is the float32 result plus one block of codes."""
        file, stored, _ = self._where[name]
        scale_file, scale_name = self._scales[name]
        scale_inv = scale_file.float32(scale_name)
        _check_finite(scale_inv, scale_name, self.directory)  # named itself, not by the block it makes non-finite
        shape, step = file.entries[stored][1], self.fp8_block[0]
        out = np.empty(shape, np.float32)
        for start in range(0, shape[0], step):
            codes = file.raw(stored, rows=slice(start, min(start + step, shape[0])))
            out[start : start + codes.shape[0]] = fp8.dequantize(codes, scale_inv, self.fp8_block, start)
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: self.tensor(name) for name in self.names()}

    def content_hash(self) -> str:
        """sha256 over config.json and every weight file, in name order: identifies the source of an export."""
        h = hashlib.sha256()
        for path in [self.directory / "config.json", *sorted(f.path for f in self.files)]:
            h.update(path.name.encode())
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
        return h.hexdigest()

    # ---- checking ----
    def _index_tensors(self) -> None:
        skipped, shared, seen = set(), [], {}
        modules = set()  # skipped layers that hold an MTP module's own tensors
        n = self.config.num_hidden_layers
        # layer n is the MTP module where it holds the module's own tensors; else layers from n on are a deeper
        # model's cut to n layers (a config edited for a quick test), which transformers reads as n layers too
        mtp = any(stored.startswith(self._mtp_prefix + own) for file in self.files for stored in file.entries
                  for own in MTP_OWN)
        for file in self.files:
            for stored, (_, shape, _, _) in file.entries.items():
                if stored in seen:  # which copy the model is would depend on the files' order
                    raise CheckpointError(f"{stored}: stored in both {seen[stored].name} and {file.path.name}; a "
                                          "checkpoint holds each tensor once")
                seen[stored] = file.path
                layer = _LAYER.match(stored)
                if layer and int(layer.group(1)) >= n + mtp:
                    skipped.add(int(layer.group(1)))  # a second or later MTP layer (the draft chains the first)
                    if stored.removeprefix(layer.group(0)).startswith(MTP_OWN):
                        modules.add(int(layer.group(1)))
                    continue
                if stored.startswith(self._mtp_prefix) and stored.removeprefix(self._mtp_prefix).startswith(MTP_SHARED):
                    shared.append(stored)  # DeepSeek-V3's copies of the embedding and the head: the main model's serve
                    continue
                if stored.endswith(".weight_scale_inv"):
                    self._scales[stored[: -len("_scale_inv")]] = (file, stored)
                    continue
                packed = _PACKED.match(stored)
                if packed:
                    self._index_packed(file, stored, packed.group(1), packed.group(2), shape)
                else:
                    self._where[stored] = (file, stored, None)
        if skipped and mtp:
            self.notes.append(f"skipped layer(s) {sorted(skipped)}: multi-token-prediction layers after the first "
                              f"(num_nextn_predict_layers={self.config.num_nextn_predict_layers}); the MTP draft "
                              f"chains layer {n}")
        elif skipped:
            self._cut = True
            self.notes.append(f"skipped layer(s) {_spans(sorted(skipped))}: past config.json's num_hidden_layers={n} "
                              f"(layer {n} is no multi-token-prediction module: no {'/'.join(MTP_OWN)}): the model "
                              f"is its first {n} layers, as transformers reads it"
                              + (f"; the MTP module at layer {_spans(sorted(modules))} drafts for the whole model: "
                                 "no MTP draft graph" if modules else ""))
        if shared:
            self.notes.append(f"{', '.join(shared)}: the MTP layer's copies of the embedding and output layer, not "
                              "read (the main model's, which they share)")

    def _index_packed(self, file: SafetensorsFile, stored: str, prefix: str, kind: str, shape: tuple) -> None:
        n_experts = shape[0] if shape else 0
        for e in range(n_experts):
            if kind == "down_proj":
                self._where[f"{prefix}.{e}.down_proj.weight"] = (file, stored, slice(e, e + 1))
            else:
                half = shape[1] // 2
                self._where[f"{prefix}.{e}.gate_proj.weight"] = (file, stored, (e, slice(0, half)))
                self._where[f"{prefix}.{e}.up_proj.weight"] = (file, stored, (e, slice(half, shape[1])))

    def _dtype(self, name: str) -> str:
        file, stored, _ = self._where[name]
        return file.entries[stored][0]

    def _shape(self, name: str) -> tuple[int, ...]:
        file, stored, rows = self._where[name]
        shape = file.entries[stored][1]
        if rows is None:
            return shape
        if isinstance(rows, slice):
            return shape[1:]
        return (shape[1] // 2, *shape[2:])

    def _check_against_config(self) -> None:
        if self.config.tie_word_embeddings and "lm_head.weight" in self._where:
            if self._same_values("lm_head.weight", "model.embed_tokens.weight"):
                self._where.pop("lm_head.weight")  # a tied checkpoint's copy of the embedding
            else:  # transformers does not tie them either: the stored head is the model's
                self.config = dataclasses.replace(self.config, tie_word_embeddings=False)
                self.notes.append("config.json ties the output layer to the embedding (tie_word_embeddings=true) "
                                  "but lm_head.weight holds other values: it is read as the output layer, untied, "
                                  "as transformers reads it (set tie_word_embeddings false to say so)")
        self._check_tensors(expected_tensors(self.config), self.names(), "checkpoint does not match config.json")
        layer = self.config.num_hidden_layers
        if self.has_mtp:
            self._check_tensors(mtp_tensors(self.config), self.mtp_names(),
                                f"the multi-token-prediction layer {layer} is incomplete")
            self.notes.append(f"layer {layer}: the multi-token-prediction (MTP) module, which an export writes as its "
                              "draft graph (not with --no-draft or --stages)")
        elif self.config.num_nextn_predict_layers and not self._cut:  # a cut model: said among the skipped
            self.notes.append(f"config.json has num_nextn_predict_layers={self.config.num_nextn_predict_layers} but "
                              f"the checkpoint holds no layer-{layer} weights: no MTP draft graph")

    def _same_values(self, a: str, b: str) -> bool:
        """Whether tensors `a` and `b` (plain, not packed or FP8) hold the same values, compared a block of rows at
        a time (the embedding of a large vocabulary is gigabytes)."""
        if b not in self._where or self._where[a][2] is not None or self._where[b][2] is not None:
            return False
        (fa, sa, _), (fb, sb, _) = self._where[a], self._where[b]
        (da, shape, *_), (db, shape_b, *_) = fa.entries[sa], fb.entries[sb]
        if shape != shape_b or a in self._scales or b in self._scales:
            return False
        step = max(1, (1 << 22) // max(1, int(np.prod(shape[1:], dtype=np.int64))))
        for start in range(0, shape[0] if shape else 1, step):
            rows = slice(start, min(start + step, shape[0])) if shape else None
            x, y = fa.raw(sa, rows=rows), fb.raw(sb, rows=rows)
            same = (np.array_equal(x, y) if da == db else
                    np.array_equal(_widened(x, da), _widened(y, db), equal_nan=True))
            if not same:
                return False
        return True

    def _check_tensors(self, expected: dict[str, tuple[int, ...]], names: list[str], what: str) -> None:
        for n in names:  # an empty tensor holds no weights: transformers saves [0, d] shared_experts for 0 of them
            if n not in expected and 0 in self._shape(n):
                self._where.pop(n)
        missing = [n for n in expected if n not in self._where]
        unexpected = [n for n in names if n not in expected and n in self._where]
        wrong = [f"{n}: {list(self._shape(n))} (expected {list(s)})"
                 for n, s in expected.items() if n in self._where and self._shape(n) != s]
        not_float = [f"{n}: {d}" for n in expected if n in self._where
                     and (d := self._dtype(n)) not in FLOAT_DTYPES]  # the model's weights, not codes of a format
        if missing or unexpected or wrong or not_float:
            parts = []
            for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong),
                                 (f"not floating point ({', '.join(FLOAT_DTYPES)})", not_float)):
                if items:
                    shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                    parts.append(f"{title} ({len(items)}): " + "; ".join(shown))
            if self._defaulted and (missing or wrong):  # a shape that follows from a field the config leaves out
                parts.append("config.json leaves out " + ", ".join(f"{k} (taken as {v})"
                                                                    for k, v in self._defaulted.items()))
            raise CheckpointError(f"{self.directory}: {what}: " + " | ".join(parts))

    def _check_fp8(self) -> None:
        """Every float8 weight has its block scales of the right grid, and every scale belongs to a float8 weight."""
        where = str(self.directory)
        fp8_weights = [n for n, (f, stored, _) in self._where.items() if f.entries[stored][0] == "F8_E4M3"]
        if fp8_weights and self.fp8_block is None:
            raise CheckpointError(f"{where}: {fp8_weights[0]} is float8_e4m3fn but config.json has no FP8 "
                                  "quantization_config (quant_method fp8, weight_block_size)")
        for name in fp8_weights:
            file, stored, rows = self._where[name]
            if rows is not None:
                raise CheckpointError(f"{where}: {stored}: packed float8 experts are not supported (store one "
                                      "weight per expert, as DeepSeek-V3 publishes them)")
            if name not in self._scales:
                raise CheckpointError(f"{where}: {name} is float8_e4m3fn but {name}_scale_inv is missing")
            if len(file.entries[stored][1]) != 2:
                raise CheckpointError(f"{where}: {name} is float8_e4m3fn of shape {list(file.entries[stored][1])}: "
                                      "block-scaled float8 weights are matrices [out, in]")
            want = fp8.scale_shape(file.entries[stored][1], self.fp8_block)
            scale_file, scale_name = self._scales[name]
            scale_dtype, got = scale_file.entries[scale_name][:2]
            if scale_dtype not in ("F32", "BF16", "F16"):
                raise CheckpointError(f"{where}: {scale_name} is {scale_dtype}: block scales are floating point "
                                      "(F32 as DeepSeek-V3 publishes them, BF16 or F16)")
            if tuple(got) != want:
                raise CheckpointError(f"{where}: {scale_name} has shape {list(got)}, expected {list(want)} (weight "
                                      f"{list(file.entries[stored][1])} in blocks of {list(self.fp8_block)})")
        orphans = sorted(set(self._scales) - set(fp8_weights))
        if orphans:
            raise CheckpointError(f"{where}: {orphans[0]}_scale_inv has no float8_e4m3fn weight to scale")
        self._scales = {n: self._scales[n] for n in fp8_weights}


def _parent_hint(path: Path) -> str:
    """Where `path` is a file of a checkpoint (its config.json, a shard): its directory, which was probably meant."""
    return f": {path.parent}?" if (path.parent / "config.json").is_file() else ""


FINITE_CHUNK = 1 << 22  # elements a finiteness check looks at at once: a 4 MB mask, not one as large as the tensor


def _check_finite(arr: np.ndarray, name: str, directory: Path) -> None:
    """CheckpointError naming `name` where it holds NaN or infinity: every logit it reaches would be NaN, and an
    export of it would sample arbitrary tokens."""
    flat = arr.reshape(-1)
    for start in range(0, flat.size, FINITE_CHUNK):
        bad = ~np.isfinite(flat[start:start + FINITE_CHUNK])
        if bad.any():
            first = start + int(np.argmax(bad))
            count = sum(int((~np.isfinite(flat[s:s + FINITE_CHUNK])).sum())
                        for s in range(start, flat.size, FINITE_CHUNK))  # this chunk's and the later ones'
            raise CheckpointError(f"{directory}: {name} holds {count} non-finite value(s) (NaN or infinity), the "
                                  f"first {float(flat[first])} at {list(map(int, np.unravel_index(first, arr.shape)))}")


def _widened(codes: np.ndarray, dtype: str) -> np.ndarray:
    """A plain tensor's stored codes as float32."""
    return bf16_to_float32(codes) if dtype == "BF16" else codes.astype(np.float32, copy=False)


def _spans(numbers: list[int]) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    spans, start = [], numbers[0]
    for prev, cur in zip(numbers, numbers[1:] + [None]):
        if cur != prev + 1:
            spans.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ", ".join(spans)


def _packed_rows(file: SafetensorsFile, stored: str, rows) -> np.ndarray:
    """One expert's matrix out of a packed [E, ...] tensor, reading only its bytes."""
    dtype = file.entries[stored][0]
    part = (
        file.raw(stored, index=rows.start) if isinstance(rows, slice) else file.raw(stored, index=rows[0], rows=rows[1])
    )
    return _widened(part, dtype)


def _safetensors_files(directory: Path) -> list[SafetensorsFile]:
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: corrupt index (no weight_map)") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: corrupt index (weight_map must map each tensor name to a file name)")
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not (directory / s).exists()]
        if absent:
            raise CheckpointError(f"{index}: shard file(s) missing: {', '.join(absent)}")
        return [SafetensorsFile(directory / s) for s in shards]
    if single.exists():
        return [SafetensorsFile(single)]
    others = sorted(directory.glob("*.safetensors"))
    if others:
        return [SafetensorsFile(p) for p in others]
    pickles = [p.name for pat in PICKLE_PATTERNS for p in directory.glob(pat)]
    if pickles:
        raise CheckpointError(
            f"{directory}: only pickle weights found ({', '.join(sorted(pickles))}); they can run code when loaded "
            "and are refused. Convert them to safetensors in a trusted environment first"
        )
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


class CheckpointView:
    """A checkpoint whose tensors read through a transformation (rounding, quantizing and dequantizing): the names
    are the source's; a subclass gives `tensor`."""

    def __init__(self, ckpt):
        self.ckpt, self.config = ckpt, ckpt.config

    def names(self) -> list[str]:
        return self.ckpt.names()

    def mtp_names(self) -> list[str]:
        return self.ckpt.mtp_names()

    @property
    def has_mtp(self) -> bool:
        return self.ckpt.has_mtp

    def tensor(self, name: str) -> np.ndarray:
        raise NotImplementedError
