"""Every choice an export makes, resolved once: `ExportOptions` (what was asked) + the model's config + the rules
below -> a frozen `ExportPlan`. The graph builders read the plan and nothing else for a choice; the manifest records
it (`manifest_fields`) and `inspect` reads it back (`from_manifest`). The rules depend on the config and the options
alone, never on the machine that exports, so one checkpoint and one set of options give the same export anywhere.

The rules (each form measured against the others: docs/benchmarks.md):
- absorb: auto picks the absorbed form that reads fewer weight bytes per decode token (export.absorb).
- precision: weights are stored in --dtype; the layers compute in float32 for every dtype (--compute auto), as
  onnxruntime's CPU provider has no bfloat16 arithmetic and widens float16 MatMuls itself (export.precision), and
  half weights are multiplied as stored by mla_deploy's MatMulF16 / MatMulBF16. --compute float16 (a float16
  export's, for a GPU) computes outside the float32 islands in float16, the weights multiplied as stored by
  onnxruntime's MatMul and MoE: a GPU reads the stored bytes, where the function bodies of a float32 compute read
  float32 copies made at load (twice the bytes); not with --quantize.
- caches: --cache-dtype auto stores both caches in --dtype. A float --cache-dtype stores both in it; int8 stores the
  latent as codes with one float32 scale per token and layer (io_spec.CacheFormat), and the roped key in --dtype:
  on the demo's held-out text an int8 k_pe cost 4x the latent's top-1 agreement with the float cache (99.41 % against
  99.72 %) for 64 of the 576 values a token caches (docs/precision.md).
- quantized ops (a quantized export): "kernel", mla_deploy's QMatMul / QGather / QRoutedExperts over codes and
  float16 scales laid out once at export (export.layouts), read where they lie in the mapped weights.bin by both
  graphs' sessions; their function bodies are stock ONNX, run where the kernel library is not registered (CUDA
  included), at the price of float32 copies of the weights folded at load. "onnxruntime": com.microsoft
  MatMulNBits / GatherBlockQuantized (and QMoE where the experts fit it) over float32 scales, which onnxruntime
  prepacks per session: its own fast kernels on CPU and CUDA, a second copy of the weights per graph. The factored
  form's per-head W^UK / W^UV are at --quantize's bits in the kernel form (mla_deploy.QBatchMatMul; llama.cpp's
  q4_0 stores its attn_k_b / attn_v_b in q4_0 too: at 4 bits the demo's held-out text loses 0.0091 nats/token
  against the float source, at 8 bits 0.0084, and the full DeepSeek-V2-Lite reads 28 MB a token less), float32 in
  onnxruntime's (MatMulNBits has no batched form).
- head bits (a quantized export's embedding and output layer, --head-bits auto): 6 for int4 on mla-deploy's kernels,
  the bytes of llama.cpp's q6_K output layer beside its q4_0 (the full DeepSeek-V2-Lite's head reads 170 MB a token
  at 6 bits against 223 MB at 8; the demo's held-out text loses 0.0084 nats/token against the float source at 6,
  0.0075 at 8 and 0.0155 at 4); 8 for int8, and for onnxruntime's ops, whose MatMulNBits takes 4 or 8 bits.
- routed experts: "kernel" for quantized exports in the kernel form (mla_deploy.QRoutedExperts: each expert on the
  tokens that chose it, reading only those experts' codes) and for float exports of layers with few experts per
  chosen one (n_routed_experts <= DENSE_RATIO x num_experts_per_tok, the demo model's 8 and 2): one
  mla_deploy.RoutedExperts per MoE layer, reading strips laid out at export in the export's dtype (its function
  body, where the kernel library is not registered, runs every expert on every token: DENSE_RATIO times the chosen
  experts' work at most; QRoutedExperts' body does the same whatever the ratio); "qmoe" for quantized exports in
  onnxruntime's form, one com.microsoft QMoE per MoE layer, where the experts' matrices are whole quantization blocks
  along K (QMoE's rule); "branches" otherwise (DeepSeek-V2-Lite's 64 and 6, V3's 256 and 8, in float), one If per
  expert, so an expert no token chose reads none of its weights. "branches" is also the portable form: stock ONNX
  that runs anywhere, CUDA included, but each If reads its condition on the host: on CUDA a decode step waits for
  the GPU once per expert, and onnxruntime captures no CUDA graph of a model with control flow (docs/gpu.md).
  "moe" (asked for, float exports): one com.microsoft MoE per MoE layer, onnxruntime's grouped kernels with no control
  flow, over float32 weights (cast at load): a form for CUDA; on the CPU its kernel decodes v2lite-2L bfloat16 in
  80 ms a step against 18 ms for the default (2 threads, docs/gpu.md).
- decode attention: "kernel" (mla_deploy.LatentAttention: scores, softmax and probs @ latent in one op that reads
  the caches as stored and only the slots each row sees; LatentAttentionQ8 over an int8 latent) where its widths fit
  the kernel's blocks (d_c a multiple of 16, d_r of 8), for half and int8 caches always (onnxruntime's ops would
  widen the whole cache to float32 in every layer of every step) and for float32 caches below KERNEL_HEADS_BELOW
  heads; "avx512" for float32 caches at KERNEL_HEADS_BELOW heads and more: the kernel under the names
  LatentAttention*Avx512, which the kernel library registers only where its kernels run AVX-512 code, so that on
  other CPUs onnxruntime runs the ops' function bodies (MLAS's 16-column panels win there at 16 heads, by 10-20 % on
  an AVX2-only CPU, and lose by 20-30 % to the kernel's 16-lane code on AVX-512 CPUs): the one choice an export
  leaves to the CPU it runs on (AVX-512 with VNNI: the library's avx512 level; heads a multiple of 16, the
  kernel's 16-lane blocks; measured at 16 heads). Under "avx512" the verify and draft graphs (T tokens a row) take
  the kernel too, as LatentAttentionChunkAvx512, which multiplies up to 8 of a row's tokens' queries by each slot
  together; a prefill chunk's absorbed form (T up to the chunk length) runs the ops, whose one MatMul of a row's
  T·h queries is ahead at long chunks (by 8 % at 17 tokens over 16k slots, one thread). "ops" otherwise:
  onnxruntime's MatMul, Softmax, MatMul (after DequantizeLinear for an int8 latent), the portable form.
- prefill attention: "absorbed" over an int8 cache where decode attention runs the kernel: a prefill chunk's
  queries against the cache as stored in mla_deploy.LatentAttentionChunkQ8, in integers, reading nothing but the
  cache; "naive" where the fused matrices are quantized (the two forms would differ by their rounding), or where
  --prefill-attention naive asks (a GPU session holds its own copy of every weight its graph reads); "per-chunk"
  otherwise: each call's one If per layer takes the form ChunkCosts (export/attention.py) finds
  cheaper for its T tokens over the slots they see: naive (the slots decompressed into per-head keys and values:
  a prompt from an empty cache, a long chunk) or absorbed (the decode graph's core over T tokens: a few tokens
  after a long cached history). Naive reads only the slots some query sees, never the whole capacity, whose score
  tensors [h, T, cap] alone are 553 MB a layer for a 512-token chunk over a 16k cache (docs/benchmarks.md).
- draft: a checkpoint with a multi-token-prediction layer (DeepSeek-V3's layer num_hidden_layers) gets the draft
  graph (draft.onnx: the MTP module, speculative decoding's proposer), unless --no-draft; every export gets the
  verify graph (verify.onnx: the decode graph's absorbed attention over any number of tokens, the verification pass;
  measured against the prefill graph's chunked form: docs/design.md).
- long cache: where a row's float32 latent cache at the export's maximum length can outgrow LONG_CACHE_BYTES, the
  ops multiply probs by the cache as MatMul's A operand (MLAS packs the B operand on every call, which then costs as
  much as the product), and the kernel op is LatentAttentionLong, whose function body does the same.
- stages (--stages N): contiguous layer ranges, the embedding in the first and the final norm and head in the last,
  chosen to make the largest stage's weight bytes as small as it can be (each tensor at the width the export stores
  it, from the config: `stored_bytes`), so that a model split over N hosts needs the least memory on the fullest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .. import io_spec, kernels
from ..checkpoint import expected_tensors
from ..config import MLAConfig
from ..errors import ExportError
from ..manifest import cache_format as manifest_cache_format
from .absorb import AbsorbMode, resolve_absorb
from .precision import DTYPES
from . import layouts
from .quantize import ACCURACY_LEVELS, BLOCKS, HEAD_BITS, Quantization, quantized_hf_names

QUANTIZE_BITS = {"int4": 4, "int8": 8}
EXPERTS = ("auto", "qmoe", "kernel", "moe", "branches")
QUANTIZED_OPS = ("auto", "kernel", "onnxruntime")
# the scales each quantized form stores: the kernels read float16 (export.layouts), MatMulNBits and QMoE take their
# activations' type (float32)
SCALE_DTYPE = {"kernel": "float16", "onnxruntime": "float32"}
BLOCK_SIZE = 32  # weights per quantization block (one scale each), unless --block-size says otherwise
ACCURACY_LEVEL = 4  # a quantized export's MatMuls quantize their activations to int8 (0: float, exact)
HEAD_BITS_INT4 = 6  # an int4 export's embedding and output layer on mla-deploy's kernels (module docstring, head bits)
DECODE_ATTENTION = ("auto", "kernel", "avx512", "ops")
PREFILL_ATTENTION = ("auto", "per-chunk", "naive")
CACHE_DTYPES = ("auto", *io_spec.FLOAT_CACHES, *io_spec.QUANTIZED_CACHES)
DENSE_RATIO = 4
KERNEL_HEADS_BELOW = 16  # auto picks the kernel over float32 caches for fewer heads than this, avx512 from it
# a row's latent cache (float32) at the export's maximum length beyond which decode attention takes the cache as the
# A operand: 8192 slots of DeepSeek's 512-wide latent
LONG_CACHE_BYTES = 16 * 2**20
PER_CHUNK = "per-chunk"  # the prefill attention whose If takes the cheaper form each call (ChunkCosts)
COMPUTE = "float32"  # what the layers compute in outside the float32 islands under --compute auto (module docstring)
COMPUTES = ("auto", "float32", "float16")
FLOAT32_ISLANDS = ("norm weights, rope tables, routers, per-head W^UK / W^UV, fused absorbed matrices (the math around "
                   "them runs in float32 too)")


@dataclass
class ExportOptions:
    """What `mla-deploy export` was asked for; ExportPlan.resolve turns it into choices."""

    absorb: str = "auto"
    dtype: str = "float32"
    max_seq_len: int | None = None  # default: the config's max_position_embeddings
    force: bool = False
    quantize: str | None = None  # "int4" or "int8": weight-only, block-wise (export.quantize)
    block_size: int | None = None  # weights per quantization block; None: BLOCK_SIZE
    accuracy_level: int | None = None  # 4 = int8 activations inside the kernel, 0 = float (exact); None: 4
    head_bits: int | None = None  # a quantized export's embedding and output layer: 4, 6 or 8; None: head_bits()
    quantized_ops: str = "auto"  # a quantized export's ops: auto (= kernel), kernel, onnxruntime
    experts: str = "auto"  # routed experts: auto, kernel, qmoe (quantized), moe (float), branches (portable)
    decode_attention: str = "auto"  # the decode graph's attention core: auto, kernel, avx512, ops (portable)
    prefill_attention: str = "auto"  # the prefill graph's: auto, per-chunk, naive (module docstring)
    cache_dtype: str = (
        "auto"  # the latent cache: auto (--dtype), float32, float16, bfloat16, int8 (io_spec.CacheFormat)
    )
    draft: bool = True  # the MTP draft graph, where the checkpoint has an MTP layer
    compute: str = "auto"  # outside the float32 islands: auto (= float32), float32, float16 (a float16 export's)
    stages: int = 1  # pipeline stages: N stage exports of contiguous layers, joined by their hidden states

    def check(self) -> None:
        """The checks that need no config, so that a bad option fails before the checkpoint is read."""
        if self.dtype not in DTYPES:
            raise ExportError(f"--dtype {self.dtype}: dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        self.quantization()
        if self.quantized_ops not in QUANTIZED_OPS:
            raise ExportError(f"--quantized-ops {self.quantized_ops}: expected one of {', '.join(QUANTIZED_OPS)}")
        if self.quantized_ops != "auto" and self.quantize is None:
            raise ExportError(f"--quantized-ops {self.quantized_ops}: chooses the ops of quantized weights (add "
                              "--quantize int4 or int8)")
        if self.experts not in EXPERTS:
            raise ExportError(f"--experts {self.experts}: expected one of {', '.join(EXPERTS)}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ExportError(
                f"--decode-attention {self.decode_attention}: expected one of {', '.join(DECODE_ATTENTION)}"
            )
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ExportError(
                f"--prefill-attention {self.prefill_attention}: expected one of {', '.join(PREFILL_ATTENTION)}"
            )
        if not isinstance(self.stages, int) or isinstance(self.stages, bool) or self.stages < 1:
            raise ExportError(f"--stages {self.stages!r}: expected a positive integer")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ExportError(f"--cache-dtype {self.cache_dtype}: expected one of {', '.join(CACHE_DTYPES)}")
        if self.compute not in COMPUTES:
            raise ExportError(f"--compute {self.compute}: expected one of {', '.join(COMPUTES)}")
        if self.compute not in ("auto", COMPUTE):
            if self.dtype != self.compute:
                raise ExportError(f"--compute {self.compute}: computes in the weights' stored dtype (add --dtype "
                                  f"{self.compute}; this export stores {self.dtype})")
            if self.quantize is not None:
                raise ExportError(f"--compute {self.compute}: with --quantize {self.quantize} the quantized ops "
                                  "compute in float32 (leave --compute out)")

    def resolved_compute(self) -> str:
        """What the layers compute in outside the float32 islands (module docstring, precision)."""
        return COMPUTE if self.compute == "auto" else self.compute

    def cache_format(self) -> io_spec.CacheFormat:
        """The caches' element types (module docstring, caches)."""
        if self.cache_dtype == "auto":
            return io_spec.CacheFormat(self.dtype, self.dtype)
        return io_spec.CacheFormat(self.cache_dtype, self.dtype if self.cache_dtype == "int8" else self.cache_dtype)

    def resolved_head_bits(self) -> int:
        """The embedding's and output layer's bits in a quantized export (module docstring, head bits)."""
        if self.head_bits is not None:
            return self.head_bits
        return HEAD_BITS_INT4 if self.quantize == "int4" and self.quantized_ops != "onnxruntime" else 8

    def quantization(self) -> Quantization | None:
        if self.quantize is None:
            if self.head_bits is not None:
                raise ExportError(f"--head-bits {self.head_bits}: the embedding and output layer keep the export's "
                                  f"--dtype unless it is quantized (add --quantize int4 or int8)")
            for option, value in (("--block-size", self.block_size), ("--accuracy-level", self.accuracy_level)):
                if value is not None:
                    raise ExportError(f"{option} {value}: applies to quantized weights (add --quantize int4 or int8)")
            return None
        if self.quantize not in QUANTIZE_BITS:
            raise ExportError(f"--quantize {self.quantize}: expected one of {', '.join(QUANTIZE_BITS)}")
        block = BLOCK_SIZE if self.block_size is None else self.block_size
        accuracy_level = ACCURACY_LEVEL if self.accuracy_level is None else self.accuracy_level
        if block not in BLOCKS:
            raise ExportError(f"--block-size {block}: expected one of {', '.join(map(str, BLOCKS))}")
        if accuracy_level not in ACCURACY_LEVELS:
            raise ExportError(f"--accuracy-level {accuracy_level}: expected one of "
                              f"{', '.join(map(str, ACCURACY_LEVELS))}")
        head_bits = self.resolved_head_bits()
        if head_bits not in HEAD_BITS:
            raise ExportError(f"--head-bits {head_bits}: expected one of {', '.join(map(str, HEAD_BITS))}")
        if head_bits == 6 and self.quantized_ops == "onnxruntime":
            raise ExportError("--head-bits 6: onnxruntime's MatMulNBits and GatherBlockQuantized take 4 or 8 bits; "
                              "a 6-bit head runs on mla-deploy's kernels (--quantized-ops auto or kernel)")
        try:
            return Quantization(QUANTIZE_BITS[self.quantize], block, accuracy_level, head_bits)
        except ValueError as e:
            raise ExportError(f"--quantize {self.quantize}: {e}") from None


@dataclass(frozen=True)
class ExportPlan:
    """The export's choices, each resolved (no "auto" left)."""

    absorb: AbsorbMode  # the decode graph's absorbed attention: FUSED or FACTORED
    dtype: str  # the weights as stored: float32, float16, bfloat16 (quantized weights: their scales' compute dtype)
    compute: str  # what the layers compute in outside the float32 islands
    cache_dtype: str  # the latent cache as stored (graph I/O): a float type, or int8 codes with a scale per entry
    rope_dtype: str  # the roped-key cache as stored: a float type
    quantization: Quantization | None  # bits, block, accuracy level, head bits, scale dtype; None: float weights
    quantized_ops: str | None  # quantized weights' ops: "kernel" or "onnxruntime"; None: float weights
    experts: str | None  # routed experts: "kernel", "qmoe", "moe" or "branches" (None: a model without any)
    decode_attention: str  # the decode attention core: "kernel", "avx512" (the kernel on AVX-512 CPUs) or "ops"
    prefill_attention: str  # "per-chunk" (naive or absorbed, each call the cheaper), "naive" (quantized fused
    # matrices) or "absorbed" (the chunk kernel over an int8 cache)
    long_cache: bool  # decode attention multiplies probs by the cache as the A operand (LatentAttentionLong)
    max_seq_len: int
    draft: bool = False  # the MTP draft graph is written (the checkpoint has an MTP layer, and it was not refused)
    stages: tuple[io_spec.Stage, ...] = ()  # a staged export's stages in order; () for one export of every layer

    @classmethod
    def resolve(cls, cfg: MLAConfig, options: ExportOptions, has_mtp: bool = False) -> "ExportPlan":
        """`has_mtp`: the checkpoint holds an MTP layer (Checkpoint.has_mtp)."""
        options.check()
        max_seq_len = options.max_seq_len or cfg.max_position_embeddings
        if not 1 <= max_seq_len <= cfg.max_position_embeddings:
            raise ExportError(f"--max-seq-len {max_seq_len}: must be between 1 and max_position_embeddings="
                              f"{cfg.max_position_embeddings}")
        absorb = resolve_absorb(cfg, options.absorb)
        quantization = options.quantization()
        quantized_ops = None
        if quantization is not None:
            quantized_ops = "kernel" if options.quantized_ops == "auto" else options.quantized_ops
            # the factored form's per-head W^UK / W^UV at the export's bits where mla_deploy.QBatchMatMul multiplies
            # them (module docstring, quantized ops)
            kernel_per_head = absorb == AbsorbMode.FACTORED and quantized_ops == "kernel"
            per_head = quantization.bits if kernel_per_head else None
            quantization = replace(quantization, scale_dtype=SCALE_DTYPE[quantized_ops], per_head_bits=per_head)
        cache = options.cache_format()
        decode_attention = resolve_decode_attention(cfg, options.decode_attention, cache.latent)
        plan = cls(
            absorb=absorb,
            dtype=options.dtype,
            compute=options.resolved_compute(),
            cache_dtype=cache.latent,
            rope_dtype=cache.rope,
            quantization=quantization,
            quantized_ops=quantized_ops,
            experts=resolve_experts(cfg, options.experts, quantization, quantized_ops),
            decode_attention=decode_attention,
            prefill_attention=resolve_prefill_attention(options.prefill_attention, cache, decode_attention, absorb,
                                                        quantization is not None),
            long_cache=long_cache(cfg, max_seq_len),
            max_seq_len=max_seq_len,
            draft=has_mtp and options.draft,
        )
        if options.stages == 1:
            return plan
        if options.stages > cfg.num_hidden_layers:
            raise ExportError(f"--stages {options.stages}: the model has {cfg.num_hidden_layers} layers, and every "
                              f"stage needs at least one")
        # a stage's graphs are prefill and decode only: speculative decoding (verify, the MTP draft) runs on one host
        return replace(plan, draft=False, stages=balanced_stages(*stored_bytes(cfg, plan), options.stages))

    @property
    def cache_format(self) -> io_spec.CacheFormat:
        return io_spec.CacheFormat(self.cache_dtype, self.rope_dtype)

    @property
    def half_kernels(self) -> bool:
        """Float weights in half precision under a float32 compute, multiplied as stored by mla_deploy's MatMulF16 /
        MatMulBF16 (a half compute multiplies them in onnxruntime's MatMul)."""
        return self.dtype in kernels.HALF_MATMUL and self.compute == COMPUTE

    def to_dict(self) -> dict:
        """Every field, JSON-ready (inspect --json)."""
        return {
            "absorb": self.absorb.value,
            "dtype": self.dtype,
            "compute": self.compute,
            "cache_dtype": self.cache_dtype,
            "rope_dtype": self.rope_dtype,
            "quantization": None if self.quantization is None else self.quantization.to_dict(),
            "quantized_ops": self.quantized_ops,
            "experts": self.experts,
            "decode_attention": self.decode_attention,
            "prefill_attention": self.prefill_attention,
            "long_cache": self.long_cache,
            "max_seq_len": self.max_seq_len,
            "draft": self.draft,
            "stages": [[s.first_layer, s.end_layer] for s in self.stages] or None,
        }

    def describe(self) -> str:
        """One line for a reader: each choice and where it runs."""
        q = self.quantization
        ops = {
            "kernel": "mla_deploy.QMatMul / QGather",
            "onnxruntime": "com.microsoft MatMulNBits / GatherBlockQuantized",
        }
        weights = (f"int{q.bits} weights (embedding and head int{q.head_bits}, blocks of {q.block}, {q.scale_dtype} "
                   f"scales, accuracy_level {q.accuracy_level}) in {ops[self.quantized_ops]}" if q
                   else f"{self.dtype} weights")
        kernel = "mla_deploy.LatentAttentionQ8" if self.cache_format.scaled else "mla_deploy.LatentAttention"
        ops = "onnxruntime's MatMul-Softmax-MatMul"
        avx512 = f"{kernels.LATENT_ATTENTION_AVX512[self.long_cache]} / {kernels.LATENT_ATTENTION_CHUNK_AVX512}"
        core = {"kernel": kernel, "avx512": f"mla_deploy.{avx512} (the kernel on AVX-512 CPUs, {ops} elsewhere; a "
                                            "prefill chunk in the ops)", "ops": ops}[self.decode_attention]
        caches = (f"int8 latent cache (a float32 scale per token and layer), {self.rope_dtype} rope cache"
                  if self.cache_format.scaled else f"{self.cache_dtype} caches" if self.cache_dtype == self.rope_dtype
                  else f"{self.cache_dtype} latent cache, {self.rope_dtype} rope cache")
        experts = {"kernel": "mla_deploy.QRoutedExperts" if q else "mla_deploy.RoutedExperts",
                   "qmoe": "com.microsoft QMoE", "moe": "com.microsoft MoE", "branches": "one If per expert"}
        return (f"absorb {self.absorb.value}; {weights} computed in {self.compute}; {caches}; "
                f"decode attention in {core}" + (" (the cache as MatMul's A operand: long cache)" if self.long_cache
                                                 else "")
                + {"absorbed": "; prefill attention absorbed in mla_deploy.LatentAttentionChunkQ8",
                   "naive": "; prefill attention naive",
                   PER_CHUNK: "; prefill attention naive or absorbed, each call the cheaper"}[self.prefill_attention]
                + (f"; routed experts in {experts.get(self.experts, self.experts)}" if self.experts else "")
                + f"; max_seq_len {self.max_seq_len}" + ("; the MTP draft graph" if self.draft else "")
                + (f"; {len(self.stages)} stages, layers " + ", ".join(f"{s.first_layer}-{s.end_layer - 1}"
                                                                      for s in self.stages) if self.stages else ""))

    def recipe(self, source_hash: str, version: str) -> str:
        """What the export id hashes: the source and every choice that is not a function of the others (the rope
        cache's dtype follows from the dtype and the cache dtype, the long-cache form from the config and the
        length)."""
        return (f"{source_hash}|{self.absorb.value}|{self.dtype}|{self.max_seq_len}|{self.quantization}|"
                f"{self.quantized_ops}|{self.experts}|{self.decode_attention}|{self.cache_dtype}|{self.draft}|{version}"
                f"|{self.prefill_attention} prefill|{self.compute} compute"
                + "".join(f"|{s.first_layer}-{s.end_layer}" for s in self.stages))

    def manifest_fields(self, cfg: MLAConfig) -> dict:
        """The manifest's record of the plan (read back by from_manifest)."""
        q = self.quantization
        fused = self.absorb == AbsorbMode.FUSED
        return {
            "absorb": self.absorb.value, "dtype": self.dtype, "max_seq_len": self.max_seq_len,
            "experts": self.experts if cfg.n_routed_experts else None, "decode_attention": self.decode_attention,
            "prefill_attention": self.prefill_attention, "long_cache": self.long_cache,
            "quantized_ops": self.quantized_ops, "draft": self.draft,
            **({"stages": [{"layers": [s.first_layer, s.end_layer]} for s in self.stages]} if self.stages else {}),
            "precision": {"dtype": self.dtype, "compute": self.compute, "caches": self.cache_dtype,
                          "rope_cache": self.rope_dtype, "float32": FLOAT32_ISLANDS},
            "quantization": None if q is None else {
                **q.to_dict(), "quantized_weights": len(quantized_hf_names(cfg)),
                "float": ("kv_b_proj (in prefill; it holds the values of the per-head W^UK / W^UV codes)"
                          if q.per_head_bits else "kv_b_proj") + ", routers, norms, rope tables"
                         + ("" if fused or q.per_head_bits else ", per-head W^UK / W^UV"),
                **({"per_head": f"per-head W^UK / W^UV at {q.per_head_bits} bits (mla_deploy.QBatchMatMul); kv_b_proj "
                                "holds the values they dequantize to"} if q.per_head_bits else {}),
                **({"absorbed": "fused W^Q·W^UK and W^UV·W^O quantized after absorption"} if fused else {}),
                "layouts": quantized_layouts(q, self.quantized_ops)},
        }

    @classmethod
    def from_manifest(cls, manifest: dict) -> "ExportPlan":
        """The plan an export was built from, as its manifest (read_manifest's, with config_obj) records it."""
        cfg, precision = manifest["config_obj"], manifest.get("precision") or {}
        quantization, cache = manifest.get("quantization"), manifest_cache_format(manifest)
        max_seq_len = int(manifest["max_seq_len"])
        recorded_long = manifest.get("long_cache")
        quantized_ops = manifest.get("quantized_ops") or ("onnxruntime" if quantization else None)
        recorded = manifest.get("stages") or []
        stages = tuple(io_spec.Stage(i, len(recorded), *_layer_range(r["layers"])) for i, r in enumerate(recorded))
        return cls(absorb=AbsorbMode(manifest["absorb"]), dtype=manifest["dtype"],
                   compute=precision.get("compute", COMPUTE), cache_dtype=cache.latent, rope_dtype=cache.rope,
                   quantization=Quantization.from_dict(quantization) if quantization else None,
                   quantized_ops=quantized_ops, experts=manifest.get("experts"),
                   decode_attention=manifest.get("decode_attention", "ops"),
                   prefill_attention=manifest.get("prefill_attention", "naive"),
                   long_cache=long_cache(cfg, max_seq_len) if recorded_long is None else bool(recorded_long),
                   max_seq_len=max_seq_len, draft=bool(manifest.get("draft", False)), stages=stages)


def quantized_layouts(q: Quantization, quantized_ops: str) -> dict:
    """How the quantized weights lie in weights.bin, by bits: what a manifest records for a reader without this code."""
    if quantized_ops == "onnxruntime":
        return {f"int{bits}": {"layout": "com.microsoft MatMulNBits", "codes": "uint8 [N, ceil(K/block), block*bits/8]",
                               "scales": f"{q.scale_dtype} [N, ceil(K/block)]", "zero_point": 2 ** (bits - 1)}
                for bits in sorted({q.bits, q.head_bits})}
    return {f"int{bits}": layouts.describe(bits, q.block) for bits in sorted({q.bits, q.head_bits})}


def resolve_experts(cfg: MLAConfig, requested: str, quantization: Quantization | None,
                    quantized_ops: str | None = "kernel") -> str:
    """How the routed experts run (module docstring). QMoE needs both expert matrices' K in whole quantization
    blocks; where they are not, auto runs the experts in branches and an explicit qmoe is refused."""
    if requested not in EXPERTS:
        raise ExportError(f"--experts {requested}: expected one of {', '.join(EXPERTS)}")
    if requested == "kernel" and quantization is not None and quantized_ops != "kernel":
        raise ExportError("--experts kernel over quantized weights is mla_deploy.QRoutedExperts, which reads float16 "
                          "scales; --quantized-ops onnxruntime stores float32 ones: use qmoe or branches")
    if requested == "qmoe" and quantization is None:
        raise ExportError("--experts qmoe needs --quantize (QMoE multiplies by quantized experts)")
    if requested == "moe" and quantization is not None:
        raise ExportError("--experts moe multiplies by float experts; over quantized ones use qmoe")
    if requested == "auto" and quantization is not None and quantized_ops == "kernel":
        return "kernel"
    if requested in ("auto", "qmoe") and quantization is not None:
        whole_blocks = cfg.hidden_size % quantization.block == 0 and cfg.moe_intermediate_size % quantization.block == 0
        if requested == "qmoe" and not whole_blocks:
            raise ExportError(f"--experts qmoe needs hidden_size and moe_intermediate_size in whole blocks of "
                              f"--block-size {quantization.block} (this config: {cfg.hidden_size} and "
                              f"{cfg.moe_intermediate_size}): use a block size dividing both, or auto / branches")
        return "qmoe" if whole_blocks else "branches"
    if requested != "auto":
        return requested
    if cfg.n_routed_experts and cfg.n_routed_experts <= DENSE_RATIO * cfg.num_experts_per_tok:
        return "kernel"
    return "branches"


def kernel_fits(cfg: MLAConfig) -> bool:
    """LatentAttention's blocks: d_c a multiple of 16, d_r of 8."""
    return cfg.kv_lora_rank % 16 == 0 and cfg.qk_rope_head_dim % 8 == 0


def resolve_decode_attention(cfg: MLAConfig, requested: str, cache_dtype: str = "float32") -> str:
    """The decode attention core (module docstring), for a latent cache stored in `cache_dtype`."""
    if requested not in DECODE_ATTENTION:
        raise ExportError(f"--decode-attention {requested}: expected one of {', '.join(DECODE_ATTENTION)}")
    if requested in ("kernel", "avx512") and not kernel_fits(cfg):
        raise ExportError(f"--decode-attention {requested} needs kv_lora_rank a multiple of 16 and qk_rope_head_dim "
                          f"of 8 (this config: {cfg.kv_lora_rank} and {cfg.qk_rope_head_dim}); use 'ops'")
    if requested == "avx512" and cache_dtype != "float32":
        raise ExportError(f"--decode-attention avx512 chooses by CPU over float32 caches; over {cache_dtype} caches "
                          "the kernel runs on every CPU: use 'kernel' or 'auto'")
    if requested != "auto":
        return requested
    if not kernel_fits(cfg):
        return "ops"
    if cfg.num_attention_heads < KERNEL_HEADS_BELOW or cache_dtype != "float32":
        return "kernel"
    return "avx512" if cfg.num_attention_heads % 16 == 0 else "ops"


def resolve_prefill_attention(requested: str, cache: io_spec.CacheFormat, decode_attention: str, absorb: AbsorbMode,
                              quantized: bool) -> str:
    """The prefill graph's attention (module docstring). auto: absorbed over an int8 cache the decode kernel reads;
    naive where the fused matrices are quantized (after absorption: the absorbed form would differ from the naive one
    by their rounding, and a prompt's result would hang on its chunking); chosen per call otherwise. naive: always
    (a prefill session then holds none of the absorbed weights: on a GPU, each session's own copy)."""
    differ = absorb == AbsorbMode.FUSED and quantized
    if requested == PER_CHUNK and differ:
        raise ExportError("--prefill-attention per-chunk: the quantized fused matrices (rounded after absorption) "
                          "would make the absorbed form differ from the naive one; use --absorb factored, or "
                          "--prefill-attention naive")
    if requested != "auto":
        return requested
    if cache.scaled and decode_attention == "kernel":
        return "absorbed"
    return "naive" if differ else PER_CHUNK


def long_cache(cfg: MLAConfig, max_seq_len: int) -> bool:
    """Whether a row's float32 latent cache at the export's full length outgrows LONG_CACHE_BYTES."""
    return max_seq_len * cfg.kv_lora_rank * 4 > LONG_CACHE_BYTES


def stored_bytes(cfg: MLAConfig, plan: ExportPlan) -> tuple[float, list[float], float]:
    """Weight bytes the export stores for the embedding, for each layer (both graphs' forms: the naive weights and
    the absorbed ones of the decode graph) and for the final norm and head, from the config: each tensor at the
    width it is stored in (quantized weights: codes plus a scale per block; a tied table counted on both ends, as
    the first and the last stage each hold it)."""
    q = plan.quantization
    itemsize = np.dtype(np.float32 if plan.dtype == "float32" else np.float16).itemsize
    quantized = set(quantized_hf_names(cfg)) if q else set()

    def size(name: str, shape: tuple[int, ...]) -> float:
        n = float(np.prod(shape))
        return n * q.bytes_per_weight(q.bits_of(name)) if name in quantized else n * itemsize

    tensors = expected_tensors(cfg)
    embedding = size("model.embed_tokens.weight", tensors["model.embed_tokens.weight"])
    head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    head = size(head_name, tensors[head_name]) + size("model.norm.weight", tensors["model.norm.weight"])
    absorbed = decode_form_bytes(cfg, plan)
    layers = [absorbed + sum(size(name, shape) for name, shape in tensors.items()
                             if name.startswith(f"model.layers.{i}.")) for i in range(cfg.num_hidden_layers)]
    return embedding, layers, head


def decode_form_bytes(cfg: MLAConfig, plan: ExportPlan) -> float:
    """Bytes a layer stores for its absorbed decode form beyond the checkpoint's own weights (export.attention):
    fused, W^Q·W^UK and W^UV·W^O (float32 islands, or codes) and the queries' rope columns; factored, the queries'
    nope and rope columns (q_b's again, split) and the per-head W^UK / W^UV (float32 islands, or codes at
    per_head_bits), o_proj being the prefill's own."""
    h, dn, dr, dc, dv = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                         cfg.kv_lora_rank, cfg.v_head_dim)
    q_in = cfg.q_lora_rank or cfg.hidden_size
    q = plan.quantization
    itemsize = 4 if plan.dtype == "float32" else 2

    def matrix(elements: int, island: bool = False) -> float:
        return elements * (q.bytes_per_weight() if q else 4 if island else itemsize)

    rope = matrix(q_in * h * dr)
    if plan.absorb == AbsorbMode.FUSED:
        return matrix(q_in * h * dc, island=True) + matrix(h * dc * cfg.hidden_size, island=True) + rope
    per_head = (h * dn * dc + h * dc * dv) * (q.bytes_per_weight(q.per_head_bits) if q and q.per_head_bits else 4)
    return matrix(q_in * h * dn) + rope + per_head


def balanced_stages(embedding: float, layers: list[float], head: float, count: int) -> tuple[io_spec.Stage, ...]:
    """`count` stages of contiguous layers, at least one each, the embedding's bytes on the first and the head's on
    the last, whose largest holds the fewest bytes (ties: the earliest cut points); exact, by dynamic programming
    over the cut points."""
    n = len(layers)
    prefix = np.concatenate([[0.0], np.cumsum(layers)])

    def stage_bytes(start: int, end: int, index: int) -> float:
        return (prefix[end] - prefix[start] + (embedding if index == 0 else 0.0)
                + (head if index == count - 1 else 0.0))

    # best[k][e]: the smallest largest-stage bytes of layers [0, e) as stages 0..k, and the cut before the last
    best = [[(np.inf, 0)] * (n + 1) for _ in range(count)]
    for e in range(1, n + 1):
        best[0][e] = (stage_bytes(0, e, 0), 0)
    for k in range(1, count):
        for e in range(k + 1, n + 1):
            best[k][e] = min(((max(best[k - 1][s][0], stage_bytes(s, e, k)), s) for s in range(k, e)),
                             key=lambda candidate: candidate[0])
    cuts, end = [], n
    for k in range(count - 1, -1, -1):
        start = best[k][end][1]
        cuts.append((start, end))
        end = start
    return tuple(io_spec.Stage(i, count, start, end) for i, (start, end) in enumerate(reversed(cuts)))


def _layer_range(recorded) -> tuple[int, int]:
    first, end = recorded
    return int(first), int(end)
