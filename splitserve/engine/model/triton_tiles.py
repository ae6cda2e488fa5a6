"""Tile loads the Triton GEMMs share (the fused MoE kernels, the FP8 linear): a tile of the
activations' rows, and a tile of a weight's rows as a dot's right operand, FP8 codes times their
block's scale (a k tile lies within one block of columns) rounded to the activations' dtype, as
`fp8.dequantize` rounds them, or the codes as stored and their scales apart (W8A8)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def input_tile(a_ptr, rows, stride_row, start, limit, valid, BLOCK_K: tl.constexpr):
    """[M, BLOCK_K]: rows `rows` of a's columns [start, start + BLOCK_K), zeros past `limit` and
    where not `valid`."""
    k = start + tl.arange(0, BLOCK_K)
    return tl.load(a_ptr + rows[:, None] * stride_row + k[None, :], mask=valid[:, None] & (k < limit)[None, :],
                   other=0.0)


@triton.jit
def weight_tile(w, scales, rows, start, limit, stride_row, stride_scale_row, block_rows, block_cols, row_ok,
                dtype: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """[BLOCK_K, N]: weight rows `rows`' columns [start, start + BLOCK_K) as a dot's right operand
    (zeros past `limit`); with FP8 each code times its block's scale (the K within one block of
    columns), in `dtype`."""
    k = start + tl.arange(0, BLOCK_K)
    tile = tl.load(w + rows[None, :] * stride_row + k[:, None], mask=(k < limit)[:, None] & row_ok[None, :], other=0.0)
    if FP8:
        scale = weight_scales(scales, rows, start, stride_scale_row, block_rows, block_cols, row_ok)
        tile = (tile.to(tl.float32) * scale[None, :]).to(dtype)
    return tile


@triton.jit
def weight_scales(scales, rows, start, stride_scale_row, block_rows, block_cols, row_ok):
    """[N]: the scale of each of weight rows `rows` at column `start` (its block's; 0 where not `row_ok`)."""
    return tl.load(scales + (rows // block_rows) * stride_scale_row + start // block_cols, mask=row_ok, other=0.0)
