"""How an export runs its routed experts, chosen from the config and the precision (each choice measured: README).

- "qmoe": quantized exports, one com.microsoft QMoE per MoE layer (faster than one If per expert at batch 1 and 8),
  where the experts' matrices are whole quantization blocks along K (QMoE's rule).
- "kernel": float exports (float32, float16, bfloat16) of layers with few experts per chosen one
  (n_routed_experts <= DENSE_RATIO x num_experts_per_tok, the demo model's 8 and 2): one mla_deploy.RoutedExperts
  per MoE layer (mla_deploy.kernels), each expert on the tokens that chose it, from strips laid out at export and
  read in the export's dtype (README, Float exports choose too); where the kernel library is not registered its
  function body runs every expert on every token, DENSE_RATIO times the chosen experts' work at most.
- "branches": the portable form (stock ONNX that runs anywhere, CUDA included) and auto's choice otherwise
  (DeepSeek-V2-Lite's 64 and 6, V3's 256 and 8): one If per expert, so an expert no token chose reads none of its
  weights. (The MoE op was measured there too: equal at batch 1, and at batch 8 faster
  than unpacked branches but slower than prepacked ones; README, Quantized exports.)
"""

from __future__ import annotations

from ..config import MLAConfig
from ..errors import ExportError
from .quantize import Quantization

CHOICES = ("auto", "qmoe", "kernel", "branches")
DENSE_RATIO = 4


def resolve_experts(cfg: MLAConfig, requested: str, quantization: Quantization | None) -> str:
    """What the graphs run, as the manifest records it. QMoE needs both expert matrices' K in whole quantization
    blocks; where they are not, the experts run in branches even if QMoE was asked for."""
    if requested not in CHOICES:
        raise ExportError(f"experts={requested!r}: expected one of {', '.join(CHOICES)}")
    if requested == "kernel" and quantization is not None:
        raise ExportError(f"experts='kernel' is for float exports (mla_deploy.RoutedExperts multiplies float32, "
                          f"float16 or bfloat16 weights); this one is int{quantization.bits}: use 'qmoe' or 'branches'")
    if requested == "qmoe" and quantization is None:
        raise ExportError("experts='qmoe' needs --quantize (QMoE multiplies by quantized experts)")
    if requested in ("auto", "qmoe") and quantization is not None:
        whole_blocks = cfg.hidden_size % quantization.block == 0 and cfg.moe_intermediate_size % quantization.block == 0
        return "qmoe" if whole_blocks else "branches"
    if requested != "auto":
        return requested
    if cfg.n_routed_experts and cfg.n_routed_experts <= DENSE_RATIO * cfg.num_experts_per_tok:
        return "kernel"
    return "branches"
