"""A quantized stack of experts dequantized on the device, a chunk of experts at a time, for the
fused-MoE kernels to read as tensors in prefills (`fused_moe.DEQUANTIZE_ASSIGNMENTS`): MXFP4 bytes
widened in one Triton pass (each nibble's E2M1 value times its group's power of two, rounded once,
as `mxfp4.dequantize` rounds it), FP8 codes times their blocks' scales (`fp8_linear.dequantize`), packed
integers as `int_linear.dequantize` widens a weight.
A chunk holds at most `DEQUANTIZE_BYTES` (transient: the engine's memory profile sees it at its
largest step); on CPU the kernel runs only under Triton's interpreter."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.engine import fp8, int_weights, mxfp4
from splitserve.engine.model import fp8_linear, int_linear

DEQUANTIZE_BYTES = 1 << 30  # the most one chunk of dequantized experts takes (transient)
DEQUANTIZE_ROWS = 64  # rows a dequantizing program widens, over one group


@triton.jit
def e2m1(codes):
    """float32 values of 4-bit E2M1 codes: sign, two exponent bits (bias 1), one mantissa bit."""
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).to(tl.float32) * 0.5
    power = (1 << exponent).to(tl.float32) * 0.5
    value = tl.where(exponent == 0, mantissa, (1.0 + mantissa) * power)
    return tl.where(codes >= 8, -value, value)


@triton.jit
def _dequantize_packed_kernel(blocks_ptr, scales_ptr, out_ptr, rows, stride_be, stride_br, stride_se, stride_sr,
                              stride_oe, stride_or, BLOCK_R: tl.constexpr):
    """One program per (expert, BLOCK_R rows, 32-value group): each nibble's E2M1 value times the
    group's power of two (as `fused_moe`'s kernels widen them), rounded once to out's dtype, the low nibble first."""
    expert, group = tl.program_id(0).to(tl.int64), tl.program_id(2)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < rows
    codes = tl.load(blocks_ptr + expert * stride_be + r[:, None] * stride_br + group * 16 + tl.arange(0, 16)[None, :],
                    mask=ok[:, None], other=0).to(tl.int32)
    exponent = tl.load(scales_ptr + expert * stride_se + r * stride_sr + group, mask=ok, other=0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)[:, None]
    values = tl.reshape(tl.join(e2m1(codes & 15) * scale, e2m1(codes >> 4) * scale), (BLOCK_R, 32))
    cols = group * 32 + tl.arange(0, 32)
    tl.store(out_ptr + expert * stride_oe + r[:, None] * stride_or + cols[None, :], values.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


def dequantize_packed(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What `mxfp4.dequantize` computes ([experts, rows, groups * 32] in `dtype`) from a stack's bytes
    [experts, rows, groups, 16] and scales [experts, rows, groups], in one pass on their device."""
    experts, rows, groups = scales.shape
    out = torch.empty((experts, rows, groups * mxfp4.GROUP), dtype=dtype, device=blocks.device)
    _dequantize_packed_kernel[(experts, triton.cdiv(rows, DEQUANTIZE_ROWS), groups)](
        blocks, scales, out, rows, blocks.stride(0), blocks.stride(1), scales.stride(0), scales.stride(1),
        out.stride(0), out.stride(1), BLOCK_R=DEQUANTIZE_ROWS)
    return out


def dequantize_experts(w: mxfp4.Packed | fp8.Stacked | int_weights.Stacked, first: int, count: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Experts [first, first + count) of a quantized stack, dequantized to `dtype` [count, rows, cols]."""
    if isinstance(w, mxfp4.Packed):
        return dequantize_packed(w.blocks[first:first + count], w.scales[first:first + count], dtype)
    if isinstance(w, int_weights.Stacked):
        zero = None if w.zero is None else w.zero[first:first + count]
        return int_linear.dequantize(w.packed[first:first + count], w.scale[first:first + count], zero, w.scheme,
                                     w.cols, dtype)
    return fp8_linear.dequantize(w.weight[first:first + count], w.scale[first:first + count], w.block, dtype)


def expert_chunks(w: torch.Tensor | mxfp4.Packed | fp8.Stacked | int_weights.Stacked,
                  dtype: torch.dtype) -> list[tuple[int, int]]:
    """(first expert, experts) of each chunk a stack dequantizes in: at most DEQUANTIZE_BYTES, one expert at least."""
    num_experts, rows, cols = w.shape
    size = max(1, DEQUANTIZE_BYTES // (rows * cols * dtype.itemsize))
    return [(first, min(size, num_experts - first)) for first in range(0, num_experts, size)]
