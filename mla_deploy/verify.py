"""Verify an export against its torch source: prefill logits, N decode steps, and generated tokens.

The runtime's own Generator (in-place caches, chunked prefill) generates N greedy tokens for a batch
of rows of different lengths (a staged export: its stages chained in this process, runtime.chain and
runtime.pipeline). Then the same prompts go through the prefill graph, and the generated
tokens through the decode graph one step at a time; the torch source takes exactly those inputs, one
decoder layer at a time (modeling.layerwise: one layer's weights in memory, so any checkpoint that
fits on disk verifies). Every step's logits are compared, and the source's greedy choice at each
step must be the token the runtime generated, unless the source itself scores the runtime's token within the
tolerance of its own choice (a near tie the export's error may flip). Tolerance: max |Δlogit| <= rtol ·
max(1, max |logit|), rtol by the export's dtypes (the weights' and the caches'): 1e-4 in float32; float16 and
bfloat16 exports are compared with the source on their rounded weights and caches
(export.precision.RoundedCheckpoint), computing in float32 like it (an export computing in float16 at
COMPUTE_RTOL), and an int8-cache export with the source whose cache entries are quantized by the same rule as they
are written (modeling.cache.stored_values), each at the rtol measured over every test configuration with a margin
(RTOL; docs/precision.md). An int8 entry whose value sits on a rounding boundary may round the other way in the
export than in the source (their float32 sums differ in order): one code step of one entry, which the int8 rtol
covers.

A quantized export is compared with the checkpoint's weights dequantized (export.quantize), exactly: its graphs
run with float activations (mla_deploy's quantized ops at accuracy_level 0, in sessions made from the graphs with
that attribute changed; MatMulNBits unpacked, where it dequantizes and multiplies in float). How far the deployed
kernels (int8 activations at accuracy_level 4) move the logits is reported beside it; whether that costs quality is
measured against the float model by `mla-deploy eval`.
Likewise an int8-cache export is compared through the exact form of its decode attention, the kernel op's function
body (DequantizeLinear, then float32), with mla-deploy's kernel library off; mla_deploy.LatentAttentionQ8, which
also quantizes the queries to int8, is run on the same steps and its distance from the exact run reported beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from . import io_spec, kernels
from .checkpoint import Checkpoint
from .errors import ExportError, ProviderError
from .export.absorb import AbsorbMode
from .export.attention import ChunkCosts
from .export.plan import PER_CHUNK
from .export.precision import RoundedCheckpoint
from .export.quantize import DequantizedCheckpoint, Quantization
from .io_spec import CacheFormat
from .manifest import cache_format, is_staged, read_manifest, require_whole
from .modeling.attention import AttentionForm
from .modeling.layerwise import layerwise_logits
from .runtime import ExportedModel, Generator, RuntimeOptions, SamplingParams
from .runtime.chain import StageChain
from .runtime.feeds import empty_caches, prefill_feed
from .runtime.session import provider_options, resolve_providers
from .runtime.pipeline import PipelineGenerator

DEFAULT_RTOL = 1e-4
# the worst measured sits 10x below in float (docs/development.md); int8 caches 3.9e-4 over 120 verifications
# (docs/precision.md)
RTOL = {"float32": DEFAULT_RTOL, "float16": 1e-3, "bfloat16": 1e-3, "int8": 1e-3}
# an export computing in float16 (--compute float16) rounds every activation outside the float32 islands to 11 bits,
# which the rounded source (computing in float32) does not: the worst measured over the test configurations, both
# absorb forms, was 2.5e-3 (docs/precision.md)
COMPUTE_RTOL = {"float16": 5e-3}
DEFAULT_STEPS = 8  # teacher-forced decode steps; steps=None: this many, or fewer where the export is shorter


def most_steps(max_seq_len: int) -> int:
    """The most teacher-forced decode steps an export of `max_seq_len` verifies: each prompt keeps one token."""
    return max_seq_len - 2


@dataclass
class VerifyReport:
    prefill_max_abs: float
    decode_max_abs: list[float]
    token_agreement: float  # fraction of runtime-generated tokens equal to the torch source's greedy tokens
    logit_scale: float
    rtol: float
    lines: list[str] = field(default_factory=list)
    # a quantized or half-precision export against the original float32 source (reported, not held to rtol): top-1
    # agreement over the teacher-forced positions, max and mean |Δlogit|
    quality: dict | None = None
    # a quantized export, prefill: the deployed session (default options, accuracy_level as exported) against the
    # exact one; an int8-cache export, decode: the steps with the kernel library against the exact ones
    deployed_drift: float | None = None
    checks: list[float] = field(
        default_factory=list
    )  # the verify graph's, the hidden state's and the draft's, in logits
    device: str = "cpu"  # where the export ran: a CUDA request without the CUDA provider falls back to the CPU

    @property
    def worst(self) -> float:
        """The largest distance; NaN where any is (max() would pass over a NaN that is not first)."""
        return float(np.max([self.prefill_max_abs, *self.decode_max_abs, *self.checks]))

    @property
    def tolerance(self) -> float:
        return self.rtol * max(1.0, self.logit_scale)

    @property
    def deployed_broken(self) -> bool:
        """The deployed run's logits are not finite: its drift is reported, not held to the tolerance, but a NaN
        there is a broken deployment, not rounding."""
        return self.deployed_drift is not None and not bool(np.isfinite(self.deployed_drift))

    @property
    def passed(self) -> bool:
        """Within the tolerance, every greedy token the same, and the deployed run not broken."""
        return self.worst <= self.tolerance and self.token_agreement == 1.0 and not self.deployed_broken


def prompt_form(manifest: dict, costs: ChunkCosts | None, tokens: int) -> AttentionForm:
    """The attention form of the prefill graph's call on prompts of `tokens` (the longest) from an empty cache:
    the manifest's, or for a per-chunk export (its `costs`) what its If takes there."""
    if costs is not None:
        return AttentionForm.ABSORBED if costs.absorbed_is_cheaper(tokens, tokens) else AttentionForm.NAIVE
    return AttentionForm(manifest.get("prefill_attention", "naive"))


def verify_export(export_dir: str | Path, checkpoint_dir: str | Path | None = None, steps: int | None = DEFAULT_STEPS,
                  rtol: float | None = None, lengths: tuple[int, ...] = (13, 7, 3), seed: int = 0,
                  provider: str = "cpu") -> VerifyReport:
    """`rtol`: default by the export's dtype (RTOL), on every provider. `provider`: where the export runs ('cpu',
    'cuda': the runtime's generation over device-resident caches; the torch source runs on the CPU). A staged export
    (export --stages N) runs its stages chained."""
    try:  # a PASS on the CPU must not read as one on the device asked for
        resolve_providers(provider, fallback=False)
    except ProviderError as e:
        raise ProviderError(f"{e}; verify runs where it is asked to, never falling back to the CPU") from None
    # Unpacked, MatMulNBits dequantizes and multiplies in float whatever its accuracy_level; mla_deploy's quantized
    # ops are given accuracy_level 0: the check is exact; so is an int8 cache's attention through its function body
    manifest = read_manifest(export_dir)
    require_whole(export_dir, manifest, "verify")
    staged = is_staged(manifest)
    exact_attention = not cache_format(manifest).scaled
    exact = RuntimeOptions(provider=provider, prepack=False, kernels=exact_attention)
    model = (StageChain(export_dir, exact, model_class=FloatActivations) if staged
             else FloatActivations(export_dir, exact))
    manifest = model.manifest
    source = Path(checkpoint_dir or manifest["source"]["path"])
    ckpt = Checkpoint(source)
    if ckpt.content_hash() != manifest["source"]["sha256"]:
        raise ExportError(f"{source}: checkpoint differs from the one {export_dir} was exported from (sha256 mismatch)")
    cfg = ckpt.config
    cache = model.cache_format
    if rtol is None:
        compute = manifest.get("precision", {}).get("compute", "float32")
        rtol = max([RTOL[d] for d in (manifest["dtype"], cache.latent, cache.rope)] + [COMPUTE_RTOL.get(compute, 0)])
    quantization = manifest.get("quantization")
    # an export is compared with the weights it stands for: rounded to its dtype, then dequantized if quantized
    reference = RoundedCheckpoint(ckpt, manifest["dtype"])
    if quantization:
        reference = DequantizedCheckpoint(
            reference, Quantization.from_dict(quantization), fused=manifest["absorb"] == "fused"
        )
    if most_steps(model.max_seq_len) < 1:
        raise ExportError(f"{export_dir}: an export of maximum length {model.max_seq_len} is too short to verify: a "
                          "prompt token and a decode step need at least 3 positions")
    steps = min(DEFAULT_STEPS, most_steps(model.max_seq_len)) if steps is None else steps
    lengths = tuple(min(n, model.max_seq_len - steps - 1) for n in lengths)
    if min(lengths) < 1:  # steps past most_steps
        raise ExportError(f"--steps {steps}: too many for the export's maximum length {model.max_seq_len} (at most "
                          f"{most_steps(model.max_seq_len)})")
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lengths]
    b, longest, capacity = len(rows), max(lengths), max(lengths) + steps
    ids = np.zeros((b, longest), np.int64)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = row
    lens = np.array(lengths, np.int64)

    # the runtime end to end: in-place caches, chunked prefill, greedy sampling (a staged export: its stages chained,
    # each with its own caches, two micro-batches in flight)
    greedy = (PipelineGenerator(model, SamplingParams(), stop_token_ids=(), micro_batches=2) if staged else
              Generator(model, SamplingParams(), chunk_size=max(1, longest // 2), stop_token_ids=()))
    generated = greedy.generate(rows, steps).token_ids
    if any(len(g) != steps for g in generated):
        raise ExportError(f"the runtime generated {[len(g) for g in generated]} tokens per row, expected {steps}")
    tokens = np.array(generated, np.int64)  # [b, steps]

    # the graphs: prefill scores every position; decode steps are fed the generated tokens
    prefill = prefill_feed(cfg, ids, capacity, cache)
    mask = prefill[io_spec.ATTENTION_MASK]
    out = model.run(io_spec.PREFILL, prefill)
    prefill_logits, prefill_hidden = out[io_spec.LOGITS], out.get(io_spec.HIDDEN)
    prefilled = {io_spec.past_of(k): v for k, v in out.items() if k.startswith("present_")}  # the caches after it
    step_logits = decode_steps(model, prefilled, tokens, lens, mask)

    # the verify graph: the generated tokens in one pass over the prefill's caches, as speculative decoding feeds it
    verify_logits = None
    if model.has_graph(io_spec.VERIFY):
        model.load(io_spec.VERIFY)
        feed = {io_spec.INPUT_IDS: tokens, io_spec.POSITION_IDS: lens[:, None] + np.arange(steps),
                io_spec.ATTENTION_MASK: mask, io_spec.WRITE_INDICES: lens}
        feed.update(prefilled)
        verify_logits = model.run(io_spec.VERIFY, feed)[io_spec.LOGITS]  # [b, steps, vocab]

    # a prefill call that takes the absorbed form (ChunkCosts): the most generated tokens that one would, as a chunk
    # over the prompts' caches (chunked prefill's branch that a prompt from an empty cache never takes)
    chunk_logits, chunk = None, 0
    costs = (ChunkCosts.of(cfg, AbsorbMode(manifest["absorb"])) if manifest.get("prefill_attention") == PER_CHUNK
             else None)
    if costs is not None:
        chunk = max((t for t in range(1, steps + 1) if costs.absorbed_is_cheaper(t, longest + t)), default=0)
    if chunk:
        feed = {io_spec.INPUT_IDS: tokens[:, :chunk], io_spec.POSITION_IDS: lens[:, None] + np.arange(chunk),
                io_spec.ATTENTION_MASK: mask, io_spec.WRITE_INDICES: lens,
                io_spec.LOGITS_POSITIONS: np.broadcast_to(np.arange(chunk), (b, chunk)).copy(), **prefilled}
        chunk_logits = model.run(io_spec.PREFILL, feed)[io_spec.LOGITS]  # [b, chunk, vocab]

    # the torch source on the same inputs, one layer at a time
    ref_prefill, ref_steps, ref_hidden, _ = (t.numpy() for t in layerwise_logits(
        reference, torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(lens), torch.from_numpy(tokens),
        stored=None if cache == CacheFormat() else cache,
        prefill_form=prompt_form(manifest, costs, longest), hidden=True))
    valid = np.arange(longest)[None, :] < lens[:, None]
    prefill_diff = float(np.abs(prefill_logits - ref_prefill)[valid].max())
    report = VerifyReport(prefill_diff, [], 0.0, float(np.abs(ref_prefill[valid]).max()), rtol)
    report.lines.append(f"prefill  batch {b}, lengths {list(lengths)}: max |Δlogit| {prefill_diff:.3e}")
    for step in range(steps):
        diff = float(np.abs(step_logits[step] - ref_steps[:, step]).max())
        report.decode_max_abs.append(diff)
        report.logit_scale = max(report.logit_scale, float(np.abs(ref_steps[:, step]).max()))
        report.lines.append(f"decode   step {step + 1:>3}: max |Δlogit| {diff:.3e}")
    if io_spec.HIDDEN in out:  # the main graphs' final hidden state, which the MTP draft reads
        diff = float(np.abs(prefill_hidden - ref_hidden)[valid].max())
        report.checks.append(diff / max(1.0, float(np.abs(ref_hidden[valid]).max())) * max(1.0, report.logit_scale))
        report.lines.append(f"hidden   prefill: max |Δ| {diff:.3e} (final hidden state, scale "
                            f"{float(np.abs(ref_hidden[valid]).max()):.2f})")
    if verify_logits is not None:
        diff = float(np.abs(verify_logits - ref_steps).max())
        report.checks.append(diff)
        report.lines.append(f"verify   {steps} token{'s' * (steps != 1)} in one pass: max |Δlogit| {diff:.3e}")
    if chunk_logits is not None:
        diff = float(np.abs(chunk_logits - ref_steps[:, :chunk]).max())
        report.checks.append(diff)
        report.lines.append(f"prefill  {chunk} token{'s' * (chunk != 1)} after the prompts, absorbed: max |Δlogit| "
                            f"{diff:.3e}")
    if model.has_draft:
        report.lines += check_draft(model, reference, ids, lens, tokens, prefill_hidden, report)

    # the source's greedy choice before each generated token: after the prompt, then after each decode step
    last = ref_prefill[np.arange(b), lens - 1]  # [b, vocab]
    before = np.concatenate([last[:, None], ref_steps[:, :-1]], axis=1)  # [b, steps, vocab]: the source's logits
    exact, ties = greedy_agreement(before, tokens, report.tolerance)
    report.token_agreement = (exact + ties) / (b * steps)
    report.lines.append(f"tokens   runtime greedy vs torch greedy: {exact}/{b * steps} agree, "
                        f"{ties} more within the tolerance of the source's own choice (near ties)")
    if quantization or cache != CacheFormat():  # the cost of the rounding, against the unrounded source
        report.quality = _quality(ckpt, ids, mask, lens, tokens, prefill_logits[valid], np.stack(step_logits, 1))
        q = report.quality
        report.lines.append(f"quality  against the float32 source, {q['positions']} teacher-forced positions: top-1 "
                            f"agreement {q['top1']:.1%}, max |Δlogit| {q['max_abs']:.3e}, mean {q['mean_abs']:.3e} "
                            "(perplexity: mla-deploy eval)")
    if quantization:  # as deployed: default options (int8 activations at accuracy_level 4)
        deployed_model = (StageChain if staged else ExportedModel)(export_dir, RuntimeOptions(provider=provider))
        deployed = deployed_model.run(io_spec.PREFILL, prefill)
        report.deployed_drift = drift = float(np.abs(deployed[io_spec.LOGITS] - prefill_logits)[valid].max())
        prepacked = (deployed_model.workers[0].model if staged else deployed_model).prepack
        ops = ("onnxruntime's MatMulNBits" if manifest.get("quantized_ops") == "onnxruntime"
               else "mla-deploy's quantized kernels") + (" and QMoE" if manifest.get("experts") == "qmoe" else "")
        ops += ", prepacked" if prepacked else ""
        report.lines.append(
            f"deployed prefill with {ops} (accuracy_level {quantization['accuracy_level']}): "
            f"max |Δlogit| {drift:.3e} from the exact run, reported, not held to the tolerance (the activations' "
            "rounding; quality against the float model: mla-deploy eval)"
        )
    if not exact_attention:  # as deployed: mla_deploy.LatentAttention(Chunk)Q8, their queries in int8
        deployed = (StageChain if staged else ExportedModel)(
            export_dir, RuntimeOptions(provider=provider, prepack=False)
        )
        prefill_drift = float(
            np.abs(deployed.run(io_spec.PREFILL, prefill)[io_spec.LOGITS] - prefill_logits)[valid].max()
        )
        kernel = decode_steps(deployed, prefilled, tokens, lens, mask)
        drift = float(np.max([np.abs(k - e).max() for k, e in zip(kernel, step_logits)]))
        report.deployed_drift = float(np.max([report.deployed_drift or 0.0, prefill_drift, drift]))
        same = int(sum((k.argmax(-1) == e.argmax(-1)).sum() for k, e in zip(kernel, step_logits)))
        where = ("onnxruntime's ops over the int8 cache" if manifest.get("decode_attention") == "ops"
                 else "mla-deploy's int8 kernels (int8 queries)")
        report.lines.append(
            f"deployed attention in {where}: max |Δlogit| from the exact "
            f"run {prefill_drift:.3e} in prefill, {drift:.3e} in decode (top-1 the same at "
            f"{same}/{b * steps} steps)"
        )
    ran = model.workers[0].model if staged else model
    report.device = ran.device
    if ran.device != "cpu":
        report.lines.append(f"device   the export ran on {ran.device} ({ran.providers[0]})")
    if report.deployed_broken:
        report.lines.append("the deployed run's logits are not finite: the export as deployed is broken")
    report.lines.append(f"{'PASS' if report.passed else 'FAIL'}: tolerance {report.tolerance:.3e} "
                        f"(rtol {rtol:g} x logit scale {max(1.0, report.logit_scale):.2f})")
    return report


class FloatActivations(ExportedModel):
    """An export whose mla_deploy quantized ops run at accuracy_level 0 (float activations: exact against the
    dequantized weights) in every graph it loads, the verify and draft graphs included: each graph read with that
    attribute changed in memory, its weights still mapped from the export's weights.bin."""

    QUANTIZED = {*kernels.QMATMUL.values(), *kernels.QBATCH_MATMUL.values(), *kernels.QROUTED_EXPERTS.values()}

    def _open(self, path: Path, options: ort.SessionOptions) -> ort.InferenceSession:
        graph = onnx.load(str(path), load_external_data=False)
        levels = [a for node in _nodes(graph.graph) if node.domain == kernels.DOMAIN and node.op_type in self.QUANTIZED
                  for a in node.attribute if a.name == "accuracy_level" and a.i != 0]
        if not levels:
            return super()._open(path, options)
        for level in levels:
            level.i = 0
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
        return ort.InferenceSession(graph.SerializeToString(), options, providers=self.providers,
                                    provider_options=provider_options(self.providers))


def _nodes(graph: onnx.GraphProto):
    """Every node of `graph`, those of its If branches included."""
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(a.g)


def decode_steps(model: ExportedModel, prefilled: dict, tokens: np.ndarray, lens: np.ndarray,
                 mask: np.ndarray) -> list[np.ndarray]:
    """Logits [b, vocab] of feeding `tokens` [b, steps] through the decode graph one step at a time, row b's token s
    at slot lens[b] + s, over the caches `prefilled` (past_* names) the prefill graph wrote."""
    caches, logits = prefilled, []
    for step in range(tokens.shape[1]):
        slot = lens + step
        feed = {io_spec.INPUT_IDS: tokens[:, step : step + 1], io_spec.POSITION_IDS: slot[:, None],
                io_spec.ATTENTION_MASK: mask, io_spec.WRITE_INDICES: slot}
        feed.update(caches)
        out = model.run(io_spec.DECODE, feed)
        caches = {io_spec.past_of(k): v for k, v in out.items() if k.startswith("present_")}
        logits.append(out[io_spec.LOGITS][:, 0])
    return logits


def check_draft(model: ExportedModel, reference, ids: np.ndarray, lens: np.ndarray, tokens: np.ndarray,
                hidden: np.ndarray, report: VerifyReport) -> list[str]:
    """The draft graph against the torch MTP module (modeling.mtp) on the same inputs: each prompt's pairs (the
    export's own prefill hidden state at i, token i + 1, the first generated token after the last) in one chunk, then
    one chained step on the draft's own hidden state and the second generated token (when there is one: `--steps 1`
    generates a single token)."""
    from .modeling import load_mtp
    from .modeling.cache import LayerCache

    draft = load_mtp(reference)
    cfg = model.config
    b, longest = ids.shape
    capacity = longest + 2
    pairs = np.zeros_like(ids)
    for r, n in enumerate(lens):
        pairs[r, : n - 1], pairs[r, n - 1] = ids[r, 1:n], tokens[r, 0]
    positions = np.broadcast_to(np.arange(longest), (b, longest)).copy()
    mask = np.ones((b, capacity), np.int64)
    feed = {
        io_spec.INPUT_IDS: pairs,
        io_spec.POSITION_IDS: positions,
        io_spec.ATTENTION_MASK: mask,
        io_spec.WRITE_INDICES: np.zeros(b, np.int64),
        io_spec.LOGITS_POSITIONS: positions,
        io_spec.PREVIOUS_HIDDEN: hidden,
        **empty_caches(cfg, b, capacity, model.cache_format, io_spec.draft_layers(cfg)),
    }
    model.load(io_spec.DRAFT)
    out = model.run(io_spec.DRAFT, feed)
    stored = None if model.cache_format == CacheFormat() else model.cache_format
    cache = LayerCache(
        torch.zeros(b, capacity, cfg.kv_lora_rank), torch.zeros(b, capacity, cfg.qk_rope_head_dim), stored
    )
    t = torch.from_numpy
    ref, ref_hidden = draft(t(pairs), t(hidden), t(positions), cache, torch.zeros(b, dtype=torch.long), t(mask))
    valid = np.arange(longest)[None, :] < lens[:, None]
    first = float(np.abs(out[io_spec.LOGITS] - ref.numpy())[valid].max())
    line = (f"draft    MTP layer {io_spec.draft_layers(cfg)[0]}, {int(lens.sum())} pairs in one chunk: max |Δlogit| "
            f"{first:.3e}")
    if tokens.shape[1] < 2:
        report.checks.append(first)
        return [line]
    # chained: the draft's own state at each row's last position, the second generated token, one position on
    last = lens - 1
    chained = {**feed, io_spec.INPUT_IDS: tokens[:, 1:2], io_spec.POSITION_IDS: lens[:, None],
               io_spec.WRITE_INDICES: lens, io_spec.LOGITS_POSITIONS: np.zeros((b, 1), np.int64),
               io_spec.PREVIOUS_HIDDEN: out[io_spec.HIDDEN][np.arange(b), last][:, None]}
    chained.update({io_spec.past_of(k): v for k, v in out.items() if k.startswith("present_")})
    out2 = model.run(io_spec.DRAFT, chained)
    ref2, _ = draft(t(tokens[:, 1:2]), ref_hidden[torch.arange(b), t(last)][:, None], t(lens[:, None]), cache, t(lens),
                    t(mask))
    second = float(np.abs(out2[io_spec.LOGITS] - ref2.numpy()).max())
    report.checks += [first, second]
    return [f"{line}; chained one more token: {second:.3e}"]


def greedy_agreement(before: np.ndarray, tokens: np.ndarray, tolerance: float) -> tuple[int, int]:
    """The source's logits before each generated token [b, steps, vocab] and the runtime's tokens [b, steps]: how
    many tokens are the source's own greedy choice, and how many others the source scores within `tolerance` of its
    choice (near ties, which an error inside the tolerance may flip)."""
    chosen = before.argmax(-1)  # [b, steps]
    margin = before.max(-1) - np.take_along_axis(before, tokens[..., None], -1)[..., 0]  # 0 where they agree
    return int((chosen == tokens).sum()), int(((chosen != tokens) & (margin <= tolerance)).sum())


def _quality(ckpt: Checkpoint, ids, mask, lens, tokens, prefill_logits: np.ndarray, step_logits: np.ndarray) -> dict:
    """The export's logits at the prompts' positions [n, vocab] and decode steps [b, steps, vocab] against the
    checkpoint's own (float32) weights on the same inputs."""
    ref_prefill, ref_steps = (t.numpy() for t in layerwise_logits(
        ckpt, torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(lens), torch.from_numpy(tokens)))
    valid = np.arange(ids.shape[1])[None, :] < lens[:, None]
    vocab = ref_prefill.shape[-1]
    ours = np.concatenate([prefill_logits, step_logits.reshape(-1, vocab)])
    theirs = np.concatenate([ref_prefill[valid], ref_steps.reshape(-1, vocab)])
    delta = np.abs(ours - theirs)
    return {"positions": len(ours), "top1": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
            "max_abs": float(delta.max()), "mean_abs": float(delta.mean())}
