"""Float32 to float8 e4m3 codes inside Triton kernels, the same bits on every GPU and under Triton's
interpreter (whose own float8 conversion drops a rounding's carry into the exponent: 31.6 gives 16):
what the FP8 KV-cache store and the W8A8 GEMM's activation quantization write."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e4m3_codes(x):
    """e4m3 codes (uint8) of float32 x, rounded to nearest even and saturated at +-448, as torch's
    float8_e4m3fn conversion of x clamped (`fp8_kv.quantize`), in integer and float32 arithmetic
    every GPU has. A normal value's 23 mantissa bits are rounded to 3 (half an ulp plus the kept
    bit's parity breaks ties to even; a carry moves into the exponent), and its exponent re-biased
    from 127 to 7; below 2**-6 (e4m3's subnormals) the code is the nearest multiple of 2**-9,
    rounded by adding 2**23, where float32's spacing is 1. The sign is x's own (-0.0 is 0x80); a NaN
    is e4m3's NaN (0x7F, with its sign), as torch converts it."""
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, subnormal, normal)
    code = tl.where(x != x, 0x7F, code)  # NaN: tl.minimum above returned 448 for it (GPUs and the interpreter alike)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)
