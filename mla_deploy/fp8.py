"""FP8 block-scaled checkpoints (DeepSeek-V3 / R1's published layout), dequantized to float32 while streaming.

Each quantized linear weight W [out, in] is stored as float8_e4m3fn codes plus `weight_scale_inv`, one float32
per block of `weight_block_size` = [128, 128] (ceil-divided at the edges), and config.json says so:

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}

    W[i, j] = e4m3(codes[i, j]) * weight_scale_inv[i // 128, j // 128]

e4m3fn (the "fn" variant: no infinities): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
subnormal (m/8 · 2^-6); the all-ones pattern S.1111.111 is NaN. Decoding is a 256-entry table, exact.
"""

from __future__ import annotations

import numpy as np

from .errors import CheckpointError


def _e4m3fn_table() -> np.ndarray:
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    normal = (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    subnormal = (mantissa / 8) * 2.0 ** -6
    values = sign * np.where(exponent == 0, subnormal, normal)
    values[(exponent == 0xF) & (mantissa == 0x7)] = np.nan
    return values.astype(np.float32)


E4M3FN = _e4m3fn_table()  # code (uint8) -> float32


def e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn codes (uint8) -> float32, exactly."""
    return E4M3FN[codes]


def dequantize(codes: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], first_row: int = 0) -> np.ndarray:
    """Rows [first_row, first_row + len(codes)) of W: codes [r, in] uint8 x their blocks' scales -> float32 [r, in].

    `scale_inv` is the whole [ceil(out / block_r), ceil(in / block_c)] grid; first_row lets a caller dequantize a
    large weight a block of rows at a time."""
    br, bc = block
    rows = np.arange(first_row, first_row + codes.shape[0]) // br  # [r] scale row of each weight row
    cols = np.arange(codes.shape[1]) // bc  # [in] scale column of each weight column
    with np.errstate(over="ignore"):  # past float32: infinite, which the reader's finiteness check names
        return e4m3_to_float32(codes) * scale_inv[rows[:, None], cols[None, :]]  # [r, in]


def block_size(config: dict, source: str) -> tuple[int, int] | None:
    """The FP8 block size from config.json's quantization_config; None when the checkpoint is not FP8.
    Refuses any other quantization method or format by name."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"{source}: quantization_config must be an object")
    method, fmt, size = q.get("quant_method"), q.get("fmt", "e4m3"), q.get("weight_block_size")
    if method != "fp8":
        raise CheckpointError(f"{source}: quantization_config.quant_method {method!r} is not supported (only 'fp8', "
                              "DeepSeek-V3's block-scaled float8); dequantize the checkpoint first")
    if fmt != "e4m3":
        raise CheckpointError(f"{source}: quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    if (not isinstance(size, list) or len(size) != 2
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)):
        raise CheckpointError(f"{source}: quantization_config.weight_block_size {size!r}: expected two positive "
                              "integers, e.g. [128, 128]")
    return size[0], size[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The weight_scale_inv grid a weight of `shape` [out, in] needs: ceil-divided at the edges."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])
