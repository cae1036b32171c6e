"""`mla-deploy inspect`: what a deployer asks first about an export or a checkpoint, from its files alone
(no onnxruntime session, no torch): the export's plan (every choice it was built with, read back from its manifest;
for a checkpoint, what `export` picks by default), parameters, weight bytes read per decode token, the graphs'
inputs, outputs and operators, and the cache MLA keeps per token in every cache format (the export's own marked)
beside MHA, GQA and MQA caches of the same heads.
"""

from __future__ import annotations

from pathlib import Path

from . import footprint, kernels
from .checkpoint import Checkpoint
from .errors import ExportLoadError, InputError
from .export.absorb import AbsorbMode, resolve_absorb
from .export.plan import ExportOptions, ExportPlan
from .export.quantize import Quantization
from .io_spec import Stage
from .manifest import MANIFEST_FILE, check_files, is_staged, read_manifest, read_stage

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def inspect_path(path: str | Path) -> dict:
    """A JSON-ready report on an export directory or a checkpoint directory."""
    path = Path(path)
    if (path / MANIFEST_FILE).is_file():
        manifest = read_manifest(path)
        cfg, absorb, dtype = manifest["config_obj"], AbsorbMode(manifest["absorb"]), manifest["dtype"]
        quantization = manifest.get("quantization")
        # a staged export: every stage's graphs, named by stage, and their weights files together
        parts = ([read_stage(path, manifest, i)[1] for i in range(len(manifest["stages"]))] if is_staged(manifest)
                 else [manifest])
        plan = ExportPlan.from_manifest(manifest)
        report = {"kind": "export", "path": str(path), "plan": plan.to_dict(),
                  "absorb": absorb.value, "dtype": dtype,
                  "decode_attention": manifest.get("decode_attention"), "experts": manifest.get("experts"),
                  "precision": manifest.get("precision"), "quantization": quantization,
                  "max_seq_len": manifest["max_seq_len"],
                  "weights_file_bytes": sum(part["weights"]["bytes"] for part in parts),
                  "graphs": {(kind if len(parts) == 1 else f"stage {i} {kind}"):
                             {"inputs": g["inputs"], "outputs": g["outputs"], "op_counts": g.get("op_counts")}
                             for i, part in enumerate(parts) for kind, g in part["graphs"].items()}}
        report["kernels"] = _kernel_ops(report["graphs"])
        report["damage"] = _damage(path, manifest)
    elif (path / "config.json").is_file():
        ckpt = Checkpoint(path)
        cfg, dtype, quantization = ckpt.config, "float32", None
        absorb = resolve_absorb(cfg, "auto")
        plan = ExportPlan.resolve(cfg, ExportOptions())
        report = {"kind": "checkpoint", "path": str(path), "plan": plan.to_dict(),
                  "absorb": f"{absorb.value} (what export --absorb auto picks)",
                  "dtype": "float32 (an export's)", "files_bytes": sum(f.path.stat().st_size for f in ckpt.files)}
    elif not path.exists():
        raise InputError(f"{path}: does not exist; expected an export or a checkpoint directory")
    elif not path.is_dir():
        meant = any((path.parent / name).is_file() for name in (MANIFEST_FILE, "config.json"))
        raise InputError(f"{path}: is a file; expected an export or a checkpoint directory"
                         + (f": {path.parent}?" if meant else ""))
    else:
        raise InputError(f"{path}: neither an export (no {MANIFEST_FILE}) nor a checkpoint (no config.json)")
    itemsize = ITEMSIZE[dtype]
    cache = footprint.cache_bytes_per_token(cfg, plan.rope_dtype)
    report.update(
        model={
            "model_type": cfg.model_type,
            "layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "heads": cfg.num_attention_heads,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "routed_experts": cfg.n_routed_experts,
            "experts_per_token": cfg.num_experts_per_tok,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": cfg.tie_word_embeddings,
        },
        parameters=footprint.parameter_counts(cfg),
        decode_read_bytes=footprint.decode_read_bytes(cfg, absorb, itemsize, **_quantized_sizes(quantization)),
        cache=footprint.cache_name(plan.cache_format),
        cache_bytes_per_token=cache,
        cache_bytes={
            kind: {str(ctx): {str(b): per_token * ctx * b for b in footprint.BATCHES} for ctx in footprint.CONTEXTS}
            for kind, per_token in cache.items()
        },
    )
    return report


def _damage(path: Path, manifest: dict) -> str | None:
    """What a load would refuse in the export's files (check_files' cheap check: graph hashes, the weights file's
    size and a sample of its blocks), or None."""
    try:
        check_files(path, manifest, "sampled")
    except ExportLoadError as e:
        return str(e)
    return None


def _kernel_ops(graphs: dict) -> dict | None:
    """The export's mla-deploy custom ops per graph, and whether this install built the library that runs them."""
    ops = {kind: {op: n for op, n in (g["op_counts"] or {}).items() if op.startswith(f"{kernels.DOMAIN}::")}
           for kind, g in graphs.items()}
    if not any(ops.values()):
        return None
    library = kernels.library()
    return {"ops": ops, "library": str(library) if library else None, "isa": kernels.isa()}


def _plan(recorded: dict) -> str:
    q, stages = recorded["quantization"], recorded.get("stages") or []
    return ExportPlan(**{**recorded, "absorb": AbsorbMode(recorded["absorb"]),
                         "quantization": Quantization.from_dict(q) if q else None,
                         "stages": tuple(Stage(i, len(stages), a, b) for i, (a, b) in enumerate(stages))}).describe()


def _quantized_sizes(q: dict | None) -> dict[str, float]:
    if not q:
        return {}
    spec = Quantization.from_dict(q)
    return {"quantized_itemsize": spec.bytes_per_weight(), "head_itemsize": spec.bytes_per_weight(spec.head_bits),
            **({"per_head_itemsize": spec.bytes_per_weight(spec.per_head_bits)} if spec.per_head_bits else {})}


def _count(n: int) -> str:
    """A parameter count as people write them: 5.38 M, 15.71 B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def size_text(n: float) -> str:
    """Bytes in decimal units: 31.89 MB, 4.34 GB."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def format_report(r: dict) -> list[str]:
    m, p = r["model"], r["parameters"]
    lines = [f"{r['kind']} {r['path']}"]
    if r.get("damage"):
        lines.append(f"DAMAGED    {r['damage']} (mla-deploy check names every damaged block)")
    layers = f"{m['layers']} layer{'' if m['layers'] == 1 else 's'}"
    lines += [
        f"model      {m['model_type']}: {layers}, hidden {m['hidden_size']}, {m['heads']} heads, latent "
        f"{m['kv_lora_rank']} + rope {m['qk_rope_head_dim']}, {m['routed_experts']} routed experts (top "
        f"{m['experts_per_token']}), vocab {m['vocab_size']}, context {m['max_position_embeddings']}",
        f"parameters {_count(p['total'])} total (the embedding {_count(p['embedding'])}), "
        f"{_count(p['active_per_token'])} multiplied per token (the experts it is routed to; the embedding a lookup"
        f"{', also the head' if m.get('tie_word_embeddings') else ''})",
        f"plan       {'' if r['kind'] == 'export' else '(what export picks by default) '}{_plan(r['plan'])}",
    ]
    precision = r.get("precision")
    if precision and precision["dtype"] != "float32":
        lines.append(f"           in float32 whatever the dtype: {precision['float32']}")
    k = r.get("kernels")
    if k:
        counts = ", ".join(
            f"{kind} {' '.join(f'{op} x{n}' for op, n in ops.items())}" for kind, ops in k["ops"].items() if ops
        )  # the graphs that have any
        how = ("run by mla-deploy's kernel library, built here: the weights are read as stored (and the caches, by "
               "LatentAttention)" if k["library"] else
               "mla-deploy's kernel library was not built here (no C compiler at install): onnxruntime runs their "
               "function bodies, on float32 copies of the weights made at load" +
               ("; RoutedExperts' body runs every expert on every token" if any(
                   "RoutedExperts" in op for ops in k["ops"].values() for op in ops) else ""))
        if k["library"] and any(op.endswith("Avx512") for ops in k["ops"].values() for op in ops):
            if k["isa"] == "avx512":
                how += "; the *Avx512 attention ops run the kernel in this process (AVX-512)"
            elif k["isa"] is None:
                how += "; the *Avx512 attention ops run onnxruntime's ops: the library here predates them (rebuild it)"
            else:
                how += (f"; the *Avx512 attention ops run onnxruntime's ops in this process (the kernels run "
                        f"{k['isa']} code here)")
        lines.append(f"kernels    {counts}; {how}")
    q = r.get("quantization")
    if q:
        lines.append(
            f"quantized  int{q['bits']} weights, int{q['head_bits']} embedding and head ({q['quantized_weights']} "
            f"tensors), blocks of {q['block']}, {q.get('scale_dtype', 'float32')} scales, accuracy_level "
            f"{q['accuracy_level']}; float: {q['float']}"
            + (f"; per-head W^UK / W^UV int{q['per_head_bits']}" if q.get("per_head_bits") else "")
        )
        for bits, layout in (q.get("layouts") or {}).items():
            lines.append(f"  {bits} layout {layout['layout']}: codes {layout['codes']}, scales {layout['scales']}")
    if r["kind"] == "export":
        lines.append(f"weights    {size_text(r['weights_file_bytes'])} in weights.bin" + (
            " (its stages' together)" if r["plan"].get("stages") else "") + f", max_seq_len {r['max_seq_len']}")
    else:
        lines.append(f"files      {size_text(r['files_bytes'])} of safetensors")
    read = r["decode_read_bytes"]
    lines.append(f"weights read per decode token: {size_text(sum(read.values()))}")
    lines += [f"  {group.replace('_', ' '):<18} {size_text(n):>10}" for group, n in read.items() if n]
    lines.append(f"cache per token (all layers), and for a whole context at batch 1 / 8 (* this "
                 f"{'export' if r['kind'] == 'export' else 'checkpoint exported by default'}):")
    head = (
        "  "
        + f"{'attention':<28} {'per token':>10} {'vs *':>7}"
        + "".join(f" {f'{c // 1024}k':>21}" for c in footprint.CONTEXTS)
    )
    lines.append(head)
    own = r["cache_bytes_per_token"][r["cache"]]
    for kind, per_token in r["cache_bytes_per_token"].items():
        at = r["cache_bytes"][kind]
        cells = "".join(f" {size_text(at[str(c)]['1']):>10}/{size_text(at[str(c)]['8']):>10}"
                        for c in footprint.CONTEXTS)
        mark = "*" if kind == r["cache"] else " "
        lines.append(f" {mark}{kind:<28} {size_text(per_token):>10} {per_token / own:>6.2f}x{cells}")
    for kind, g in r.get("graphs", {}).items():
        lines.append(f"{kind} graph:")
        for direction in ("inputs", "outputs"):
            specs = g[direction]
            shown = [s for s in specs if not s["name"].startswith(("past_", "present_"))]
            caches = len(specs) - len(shown)
            text = ", ".join(f"{s['name']} {s['dtype']}[{', '.join(map(str, s['shape']))}]" for s in shown)
            lines.append(f"  {direction:<8} {text}" + (f" + {caches} cache tensors" if caches else ""))
        if g["op_counts"]:
            lines.append("  ops      " + ", ".join(f"{op} {n}" for op, n in g["op_counts"].items()))
    return lines
