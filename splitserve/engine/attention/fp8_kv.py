"""The FP8 KV cache (`kv_cache_dtype: fp8`): K and V stored as float8 e4m3 codes, a byte a value,
half the bytes of a bf16 cache, so twice the tokens fit and a decode step reads half the KV.

Each layer's K and V have one scale each (stored code = value / scale, saturated at e4m3's
+-448), read from the checkpoint where it has them, else 1.0, as vLLM. The cache holds the codes
as uint8, so every copy (KV transfer over gloo, NCCL or gRPC; index ops, which CPU torch lacks for
float8) moves plain bytes; a uint8 cache layer means e4m3 codes to every attention backend. Values
are quantized once, when stored, and every read of them (this step's own tokens too) sees the
stored codes times the scale, rounded to the serving dtype.
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # auto: the serving dtype; fp8 is e4m3
CODES = torch.uint8
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


def storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """What the cache tensor holds: codes for FP8, else values in the serving `dtype`."""
    return CODES if is_fp8(kv_cache_dtype) else dtype


def holds_codes(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == CODES


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 codes (uint8) of x / scale, rounded to nearest even and saturated at +-448. The
    division is a float32 multiply by 1 / scale (a float32), as the Triton store computes it."""
    return (x.float() * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).view(CODES)


def rounded(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as a read of the cache returns it once stored: its codes' values, in x's dtype."""
    return dequantize(quantize(x, scale), scale, x.dtype)


def dequantize(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The values codes (uint8) stand for: code times scale in float32, rounded once to `dtype`.
    Widened with integer bit moves, as the Triton kernels do on GPUs without an e4m3 conversion
    (`triton_kernels._e4m3_halves`: the sign and the 7 exponent and mantissa bits placed in a
    float16 make value / 2**8), which CPU torch runs vectorized, about twice as fast as its float8
    conversion; the values are the same."""
    bits = codes.to(torch.int16)
    half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).view(torch.float16)
    return half.to(torch.float32).mul_(256.0 * scale).to(dtype)
